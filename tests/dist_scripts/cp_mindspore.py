"""Context-parallel MindSpore Qwen3.5 (``load_model(..., backend="mindspore", cp=2)``) against the same
checkpoint on one device (rank 0 also loads it whole and shares its
outputs). Prints one line per check,
``rank R: <check> <label> ...`` (the format of tests/dist_scripts/cp_torch.py); it never raises on
a failed comparison (a rank that stopped early would leave the other hanging in a collective):
tests/test_cp_mindspore.py reads the lines from the worker logs.

usage: cp_mindspore.py LABEL=CHECKPOINT_DIR ...
"""

import sys

import numpy as np
from cp_mindspore_contract import (
    REFERENCE_RANK,
    contract_run,
    shared_reference,
    single_tokens,
)  # this folder: on sys.path as the script's

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.cache import DynamicCache, StaticCache
from hyper_gen.parallel.launcher import host_ops, init_distributed

assert init_distributed("mindspore")
ops = host_ops("mindspore")
rank, world = ops.rank(), ops.world_size()
checkpoints = [arg.split("=", 1) for arg in sys.argv[1:]]
WIDTHS = (70, 200)  # neither a multiple of the 64-position chunk nor of the rank count
SHORT_WIDTHS = (1, 129)  # shorter than the ranks; a one-position last slice (conv halo over 1 row)
DECODE_STEPS = 3
ATTENTION_LAYERS = (1, 3)


def say(line):
    print(line, flush=True)


def padded_batch(vocab, width, seed=0):
    """A left-padded batch: a ``width``-token row, a 3-token row and a 17-token one."""
    lengths = (width, 3, 17) if width > 17 else (width,)
    rng = np.random.default_rng(seed + width)
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = rng.integers(1, vocab, n)
        mask[row, width - n :] = 1
    return ids, mask, rng.integers(1, vocab, (len(lengths), DECODE_STEPS))


def expected_kv_length(model, width, cache):
    """What this rank's cache must hold per attention layer: its slice (the owner: + decode)."""
    plan = model.cp_plan
    layout = plan.layout(width)
    if cache.is_static:
        return layout.static_capacity(plan.rank, cache.max_length)
    start, stop = layout.cached_columns(plan.rank, cache.seq_length)
    return stop - start


model = None
for index, (label, path) in enumerate(checkpoints):
    for dtype in ("float32", "float64") if index == 0 else ("float64",):  # MoE: float64 (tests/test_cp_mindspore.py)
        model = load_model(path, backend="mindspore", dtype=dtype, cp=world)
        single = load_model(path, backend="mindspore", dtype=dtype) if rank == REFERENCE_RANK else None
        tag = f"rank {rank}: {{}} {label}/{dtype}"
        say(
            tag.format("attributes") + f" group={model.parallel_group} vocab_parallel={model.vocab_parallel} "
            f"cp_plan={model.cp_plan} tp_plan={model.tp_plan}"
        )
        for width in WIDTHS:
            ids, mask, decode_ids = padded_batch(model.vocab_size, width)
            diff, kv_ok, kv_lengths = 0.0, True, []
            for cache_class in (StaticCache, DynamicCache):
                ours, cache = contract_run(model, ids, mask, decode_ids, cache_class, dtype)
                reference = (
                    contract_run(single, ids, mask, decode_ids, cache_class, dtype)[0] if single is not None else None
                )
                reference = shared_reference(ops, rank, reference, ours)
                diff = max(diff, max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(ours, reference)))
                want = expected_kv_length(model, width, cache)
                got = [cache.keys[i].shape[2] if i in cache.keys else 0 for i in ATTENTION_LAYERS]
                got += [cache.values[i].shape[2] if i in cache.values else 0 for i in ATTENTION_LAYERS]
                kv_ok &= all(n == want for n in got) and want < cache.max_length
                kv_lengths.append((cache_class.__name__, got[0], want, cache.max_length))
            say(tag.format("logits") + f" width={width} maxdiff={diff:.3e}")
            say(tag.format("kvshard") + f" width={width} ok={kv_ok} lengths={kv_lengths}")

        greedy = GenerationConfig(max_new_tokens=6, eos_token_id=None, pad_token_id=0)
        seeded = greedy.replace(do_sample=True, seed=11, top_k=0, temperature=1.3)
        runs = [("greedy", greedy), ("seeded", seeded), ("dynamic", greedy.replace(cache_implementation="dynamic"))]
        for width in WIDTHS + SHORT_WIDTHS:
            ids, mask, _ = padded_batch(model.vocab_size, width)
            for name, cfg in runs:
                if name == "dynamic" and width not in WIDTHS:
                    continue
                got = generate(model, ids, cfg, attention_mask=mask).asnumpy()
                equal = single_tokens(single, ids, cfg, mask, got)
                say(tag.format(name) + f" width={width} equal={equal} tokens={got.tolist()}")

# a rank handed a different prompt: the same ValueError on every rank, no hang
ids, mask, _ = padded_batch(model.vocab_size, 70)
different = ids.copy()
different[0, -1] = different[0, -1] % (model.vocab_size - 1) + 1
cfg = GenerationConfig(max_new_tokens=3, eos_token_id=None)
try:
    generate(model, different if rank == 1 else ids, cfg, attention_mask=mask)
    say(f"rank {rank}: mismatch NO ERROR")
except ValueError as exc:
    say(f"rank {rank}: mismatch ValueError: {exc}")
out = generate(model, ids, cfg, attention_mask=mask).asnumpy()  # the ranks are still in step afterwards
say(f"rank {rank}: after-mismatch tokens={out.tolist()}")
try:
    load_model(checkpoints[0][1], backend="mindspore", cp=4)
    say(f"rank {rank}: world NO ERROR")
except ValueError as exc:
    say(f"rank {rank}: world ValueError: {exc}")
say(f"rank {rank}: done")
