"""Two ranks: ``generate()`` refusing bad input given on ONE rank only, on split torch models
(tests/test_generate_refusals_distributed.py).

usage: generate_refusals_torch.py CHECKPOINT_DIR

- the native Qwen3.5 loaded ``tp=2`` (a model-parallel group: the ranks compare their inputs);
- an HF Qwen3.5 sharded with FSDP2 ``fully_shard`` (collective forwards: step-synced), each rank its
  own batch;
- a multi-rank Engine on the TP model: ``submit`` on rank 1 (only rank 0 takes requests).

Every case first runs on both ranks, then the same model generates again and is compared with
the tokens it gave before the case. Prints ``rank R: <check> <label> <values>`` lines and never
raises between collectives (a rank stopping early would leave the other waiting in one).
"""

import sys

import torch
import torch.distributed as dist
from rollout_common import CharTokenizer, build_model, catch, prompts, say, setup
from torch.distributed.fsdp import fully_shard
from torch_exit import exit_past_teardown  # this folder: on sys.path as the script's

from hyper_gen import generate, load_model
from hyper_gen.config import MAX_ROWS
from hyper_gen.engine import Engine

rank, world = setup(timeout_s=60)
assert world == 2, world
PATH = sys.argv[1]


def keep_all(input_ids, scores):
    return scores


def on_rank_1(bad, good):
    return bad if rank == 1 else good


def cases(ids, mask, vocab):
    """label -> this rank's generate() keyword arguments (rank 1 gets the bad or different one)."""
    oov = ids.clone()
    oov[-1, -1] = vocab + 3
    tokenizer = CharTokenizer()
    return {
        # refused on rank 1 only: rank 1 raises its own error, rank 0 one naming rank 1
        "mask_shape": dict(attention_mask=on_rank_1(mask[:, 1:], mask)),
        "oov": dict(input_ids=on_rank_1(oov, ids)),
        "config": dict(top_k=on_rank_1(-1, 50)),
        "unknown_kwarg": on_rank_1(dict(max_new_tokenz=4), {}),
        "rows": on_rank_1(dict(do_sample=True, seed=0, num_return_sequences=MAX_ROWS), {}),
        "stop_tokenizer": dict(stop_strings="@@@@", tokenizer=on_rank_1(None, tokenizer)),
        # valid on both ranks but different: every rank raises the same error naming the field and rank 1
        "n_differs": on_rank_1(dict(do_sample=True, seed=0, num_return_sequences=2), {}),
        "stop_differs": dict(stop_strings=on_rank_1("@@@@", None), tokenizer=tokenizer),
        "processor_differs": dict(logits_processor=on_rank_1([keep_all], None)),
        "synced_differs": on_rank_1(dict(synced_gpus=True), {}),  # one rank alone asks for the step sync
    }


def run_cases(kind, model, ids, mask, vocab, **common):
    before = generate(model, ids, attention_mask=mask, **common).tolist()
    for label, given in cases(ids, mask, vocab).items():
        call = {"input_ids": ids, "attention_mask": mask, **common, **given}
        kind_, message, seconds, _ = catch(lambda call=call: generate(model, **call))
        say(rank, kind, label, f"type={kind_} seconds={seconds:.2f} message={message}")
        after = generate(model, ids, attention_mask=mask, **common).tolist()
        say(rank, kind + "_after", label, f"same={after == before}")
    return before


# ------------------------------------------------------------------ native tensor parallelism

tp_model = load_model(PATH, backend="torch", dtype="float32", tp=2)
ids, mask = prompts((6, 3, 8), tp_model.vocab_size, seed=0)  # the same on both ranks
greedy = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
before = run_cases("tp", tp_model, ids, mask, tp_model.vocab_size, **greedy)
single = load_model(PATH, backend="torch", dtype="float32")
say(rank, "tp_single", "greedy", f"same={generate(single, ids, attention_mask=mask, **greedy).tolist() == before}")
del single

# a multi-rank engine takes requests on rank 0 only: submit elsewhere is refused, with no collective
engine = Engine(tp_model)
if rank == 1:
    kind_, message, seconds, _ = catch(lambda engine=engine: engine.submit([5, 6, 7]))
    say(rank, "engine", "submit", f"type={kind_} seconds={seconds:.2f} message={message}")
del engine

# ---------------------------------------------------------------------------------- FSDP2

VOCAB = 97
sharded = build_model(dtype=torch.float32)
for layer in sharded.model.layers:
    fully_shard(layer)
fully_shard(sharded)
ids, mask = prompts({0: (5, 3), 1: (8, 2, 6)}[rank], VOCAB, seed=10 + rank)  # each rank its own batch
run_cases("fsdp", sharded, ids, mask, VOCAB, **greedy)
say(rank, "done", "all", "ok")
del sharded, tp_model
dist.barrier()  # leave together: a rank whose peer tore its gloo pairs down first can abort at exit
exit_past_teardown()
