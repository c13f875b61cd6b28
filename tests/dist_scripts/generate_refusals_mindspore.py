"""Two msrun ranks: ``generate()`` refusing bad input given on ONE rank only, on the native MindSpore
Qwen3.5 loaded ``tp=2`` (tests/test_generate_refusals_distributed.py).

usage: generate_refusals_mindspore.py CHECKPOINT_DIR

The cases of generate_refusals_torch.py's tensor-parallel part: every case runs on both ranks, then
the same model generates again and is compared with the tokens it gave before the case. Prints one
``REFUSAL {json}`` line per check and rank; nothing raises between collectives.
"""

import json
import sys
import time

import numpy as np

from hyper_gen import generate, load_model
from hyper_gen.config import MAX_ROWS
from hyper_gen.engine import Engine
from hyper_gen.parallel.launcher import host_ops, init_distributed

assert init_distributed("mindspore")
ops = host_ops("mindspore")
rank, world = ops.rank(), ops.world_size()
assert world == 2, world
PATH = sys.argv[1]
WIDTH = 8


def report(check, label, **values):
    print("REFUSAL " + json.dumps(dict(rank=rank, check=check, label=label, **values)), flush=True)


def caught(fn):
    start = time.monotonic()
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - what every rank raised is the finding
        return dict(type=type(error).__name__, message=str(error), seconds=time.monotonic() - start)
    return dict(type=None, message=None, seconds=time.monotonic() - start)


class CharTokenizer:
    """Just what stop_strings needs of an HF tokenizer: token id i reads as chr(0x100 + i)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - 0x100 for c in text]}

    def convert_ids_to_tokens(self, ids):
        return [chr(0x100 + int(i)) for i in ids] if isinstance(ids, list) else chr(0x100 + int(ids))

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)


def keep_all(input_ids, scores):
    return scores


def on_rank_1(bad, good):
    return bad if rank == 1 else good


def left_padded(lengths, vocab, seed):
    rng = np.random.default_rng(seed)  # the same on every rank
    ids = np.zeros((len(lengths), WIDTH), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, WIDTH - n :] = rng.integers(8, vocab, n)
        mask[row, WIDTH - n :] = 1
    return ids, mask


model = load_model(PATH, backend="mindspore", dtype="float32", tp=2)
vocab = model.vocab_size
ids, mask = left_padded((6, 3, 8), vocab, seed=0)
oov = ids.copy()
oov[-1, -1] = vocab + 3
tokenizer = CharTokenizer()
CASES = {  # as generate_refusals_torch.py's
    "mask_shape": dict(attention_mask=on_rank_1(mask[:, 1:], mask)),
    "oov": dict(input_ids=on_rank_1(oov, ids)),
    "config": dict(top_k=on_rank_1(-1, 50)),
    "unknown_kwarg": on_rank_1(dict(max_new_tokenz=4), {}),
    "rows": on_rank_1(dict(do_sample=True, seed=0, num_return_sequences=MAX_ROWS), {}),
    "stop_tokenizer": dict(stop_strings="@@@@", tokenizer=on_rank_1(None, tokenizer)),
    "n_differs": on_rank_1(dict(do_sample=True, seed=0, num_return_sequences=2), {}),
    "stop_differs": dict(stop_strings=on_rank_1("@@@@", None), tokenizer=tokenizer),
    "processor_differs": dict(logits_processor=on_rank_1([keep_all], None)),
    "synced_differs": on_rank_1(dict(synced_gpus=True), {}),
}
greedy = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
before = generate(model, ids, attention_mask=mask, **greedy).asnumpy().tolist()
for label, given in CASES.items():
    call = {"input_ids": ids, "attention_mask": mask, **greedy, **given}
    report("tp", label, **caught(lambda call=call: generate(model, **call)))
    after = generate(model, ids, attention_mask=mask, **greedy).asnumpy().tolist()
    report("tp_after", label, same=after == before)
single = load_model(PATH, backend="mindspore", dtype="float32")
report("tp_single", "greedy", same=generate(single, ids, attention_mask=mask, **greedy).asnumpy().tolist() == before)
engine = Engine(model)
if rank == 1:
    report("engine", "submit", **caught(lambda: engine.submit([5, 6, 7])))
print(f"rank {rank}: done", flush=True)
