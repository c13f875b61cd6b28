"""tp=2 x cp=2 MindSpore Qwen3.5 (``load_model(..., backend="mindspore", tp=2, cp=2)``, 4 msrun workers)
against the same checkpoint on one device (rank 0 also loads it whole and shares its outputs). Prints one line per
check, ``rank R: <check> <label> ...``; it never raises on a failed comparison (a rank that stopped
early would leave the others hanging in a collective): tests/test_cp_tp_mindspore.py reads the
lines from the worker logs.

usage: cp_tp_mindspore.py LABEL=CHECKPOINT_DIR ...
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
from hyper_gen.backends.mindspore import compile as ms_compile
from hyper_gen.cache import DynamicCache, StaticCache
from hyper_gen.parallel.launcher import host_ops, init_distributed

assert init_distributed("mindspore")
ops = host_ops("mindspore")
rank, world = ops.rank(), ops.world_size()
checkpoints = [arg.split("=", 1) for arg in sys.argv[1:]]
TP, CP = 2, 2
# a left-padded batch per width: rows of the width, 70 tokens (at 200) and 3 tokens; 70 and 200
# are neither multiples of the 64-position chunk nor of the ranks (slices 64|6 and 128|72)
ROWS = {70: (70, 3), 200: (200, 70, 3)}
NEW_TOKENS = 4
ATTENTION_LAYERS = (1, 3)
# float64 (the 1e-9 logit bar; its tp sums and every cp / vocab gather run as world AllGathers of
# raw bits) on both checkpoints; float32 (tp sums by AllReduce on the tp subgroup) on the first
DTYPES = ("float64", "float32")


def say(line):
    print(line, flush=True)


def padded_batch(vocab, width):
    rng = np.random.default_rng(width)
    lengths = ROWS[width]
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = rng.integers(1, vocab, n)
        mask[row, width - n :] = 1
    return ids, mask


def kv_sliced(model, width, cache):
    """Each attention layer's cache holds this rank's cp slice only (the owner: + decode)."""
    plan, layout = model.cp_plan, model.cp_plan.layout(width)
    if cache.is_static:
        want = layout.static_capacity(plan.rank, cache.max_length)
    else:
        start, stop = layout.cached_columns(plan.rank, cache.seq_length)
        want = stop - start
    got = [cache.keys[i].shape[2] if i in cache.keys else 0 for i in ATTENTION_LAYERS]
    return all(n == want for n in got) and want < cache.max_length


model = None
for index, (label, path) in enumerate(checkpoints):
    for dtype in DTYPES if index == 0 else DTYPES[:1]:
        # $HYPER_GEN_MINDSPORE_JIT (read at import) for this run: compiling the one-token blocks for every
        # batch size and dtype on 4 ranks was most of this job, so they run compiled on the first run
        # (float64, the 1e-9 bar) and PyNative, their bit-for-bit equal (test_mindspore_compiled_decode.py),
        # on the others
        ms_compile.COMPILED_DECODE = (index, dtype) == (0, DTYPES[0])
        model = load_model(path, backend="mindspore", dtype=dtype, tp=TP, cp=CP)
        single = load_model(path, backend="mindspore", dtype=dtype) if rank == REFERENCE_RANK else None
        tag = f"rank {rank}: {{}} {label}/{dtype}"
        say(
            tag.format("attributes") + f" group={model.parallel_group} vocab_parallel={model.vocab_parallel} "
            f"cp_plan={model.cp_plan} tp_plan={model.tp_plan} tp_group={model.tp_group} "
            f"cp_group={model.context_parallel.group} vocab={model.vocab_size}"
        )
        greedy = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        seeded = greedy.replace(do_sample=True, seed=11, top_k=0, temperature=1.3)
        for width in ROWS:
            ids, mask = padded_batch(model.vocab_size, width)
            for name, cfg in (("greedy", greedy), ("seeded", seeded)):
                got = generate(model, ids, cfg, attention_mask=mask).asnumpy()
                equal = single_tokens(single, ids, cfg, mask, got)
                say(tag.format(name) + f" width={width} equal={equal} tokens={got.tolist()}")
                if name == "greedy":  # rows are [prompt | generated | pad]: the greedy tokens (one device's on rank 0)
                    decode_ids = np.stack([got[i, n : n + NEW_TOKENS] for i, n in enumerate(mask.sum(1))])
            # every step's logits, teacher-forced on one device's greedy tokens (a static cache, as
            # generate() uses; a dynamic one too for the float64 200-token batch)
            diff, kv_ok = 0.0, True
            for cache_class in (StaticCache, DynamicCache) if (dtype, width) == ("float64", 200) else (StaticCache,):
                ours, cache = contract_run(model, ids, mask, decode_ids, cache_class, dtype)
                reference = None
                if single is not None:
                    reference, _ = contract_run(single, ids, mask, decode_ids, cache_class, dtype)
                    kv_ok &= all(a.shape == b.shape for a, b in zip(ours, reference))
                reference = shared_reference(ops, rank, reference, ours)
                diff = max(diff, max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(ours, reference)))
                kv_ok &= kv_sliced(model, width, cache)
            say(tag.format("logits") + f" width={width} steps={len(ours)} maxdiff={diff:.3e} kv_ok={kv_ok}")

# a rank handed a different prompt: the same ValueError on all 4 ranks (the input check spans the
# whole mesh, not one tp or cp group), then the ranks are still in step
ids, mask = padded_batch(model.vocab_size, 70)
different = ids.copy()
different[0, -1] = different[0, -1] % (model.vocab_size - 1) + 1
cfg = GenerationConfig(max_new_tokens=2, eos_token_id=None)
try:
    generate(model, different if rank == world - 1 else ids, cfg, attention_mask=mask)
    say(f"rank {rank}: mismatch NO ERROR")
except ValueError as exc:
    say(f"rank {rank}: mismatch ValueError: {exc}")
out = generate(model, ids, cfg, attention_mask=mask).asnumpy()
say(f"rank {rank}: after-mismatch tokens={out.tolist()}")

# a mesh other than the world: load_model's check, and the port's own (a direct load() call)
from hyper_gen.backends.mindspore.models import qwen3_5  # noqa: E402
from hyper_gen.models.checkpoint import Checkpoint  # noqa: E402
from hyper_gen.parallel.cp_plan import CPPlan  # noqa: E402
from hyper_gen.parallel.tp_plan import TPPlan  # noqa: E402

try:
    load_model(checkpoints[0][1], backend="mindspore", tp=2, cp=4)
    say(f"rank {rank}: world NO ERROR")
except ValueError as exc:
    say(f"rank {rank}: world ValueError: {exc}")
try:
    qwen3_5.load(Checkpoint(checkpoints[0][1]), "float32", plan=TPPlan(2, rank % 2), cp_plan=CPPlan(4, rank // 2))
    say(f"rank {rank}: port-world NO ERROR")
except ValueError as exc:
    say(f"rank {rank}: port-world ValueError: {exc}")
say(f"rank {rank}: done")
