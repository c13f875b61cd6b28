"""Two ranks: the tensor-parallel MindSpore Qwen3.5 (TP=2) against the single-device model.

usage: tp_mindspore.py KIND=CHECKPOINT [KIND=CHECKPOINT ...]

Kinds ``dense`` and ``moe`` get every check; any other kind (e.g. a single-KV-head variant, where
both ranks keep the one KV head) gets the float64 logits, read and greedy checks only. Every rank
also builds the whole (tp=1) model locally, so each comparison runs in one process.
Prints one ``TP {json}`` line per check and rank; tests/test_tp_mindspore.py asserts on them.
Every rank makes the same collective calls in the same order (a rank that skipped one would hang
the other), so nothing here raises between collectives: results are reported, not asserted.
"""

import json
import sys

import mindspore as ms
import numpy as np

from hyper_gen import GenerationConfig, generate
from hyper_gen.backends.mindspore import compile as ms_compile
from hyper_gen.backends.mindspore.models import qwen3_5
from hyper_gen.backends.mindspore.ops import MindSporeOps
from hyper_gen.cache import StaticCache
from hyper_gen.models.checkpoint import Checkpoint
from hyper_gen.parallel.launcher import host_ops, init_distributed
from hyper_gen.parallel.tp_plan import TPPlan

assert init_distributed("mindspore")
ops = host_ops("mindspore")
rank, world = ops.rank(), ops.world_size()
assert world == 2, world
PLAN = TPPlan(2, rank)
REPLICATED = ("norm.weight", "mlp.gate.weight", "mlp.shared_expert_gate.weight")  # name endings


def report(kind, check, **values):
    print("TP " + json.dumps(dict(rank=rank, kind=kind, check=check, **values)), flush=True)


class RecordingCheckpoint(Checkpoint):
    """A Checkpoint that remembers every read: (name, elements read, whole tensor?)."""

    def __init__(self, path):
        super().__init__(path)
        self.reads = []

    def _read(self, name, window, dtype):
        array = super()._read(name, window, dtype)
        self.reads.append((name, int(array.size), window is None))
        return array


# ------------------------------------------------------------------------------ inputs

CHECKPOINTS = dict(arg.split("=", 1) for arg in sys.argv[1:])
FULL_KINDS = ("dense", "moe")
VOCAB = Checkpoint(next(iter(CHECKPOINTS.values()))).config["vocab_size"]
rng = np.random.default_rng(0)  # same seed on every rank: every rank gets the same inputs
LENGTHS = (70, 5, 21)  # 70 > one 64-token Gated DeltaNet chunk
PROMPTS = [rng.integers(1, VOCAB, n).tolist() for n in LENGTHS]
DECODE = rng.integers(1, VOCAB, (len(LENGTHS), 3))
WIDTH = max(LENGTHS)
PADS = [WIDTH - n for n in LENGTHS]
IDS = np.zeros((len(LENGTHS), WIDTH), np.int64)
MASK = np.zeros_like(IDS)
for row, (prompt, pad) in enumerate(zip(PROMPTS, PADS)):
    IDS[row, pad:] = prompt
    MASK[row, pad:] = 1


def contract_mask(past, seq, total, dtype):
    cols = np.arange(total)[None, None, :]
    rows = np.arange(past, past + seq)[None, :, None]
    visible = (cols <= rows) & (cols >= np.asarray(PADS)[:, None, None])
    return ms.Tensor(np.where(visible, 0, np.finfo(dtype).min).astype(dtype)[:, None])


def forwards(model, dtype):
    """Logits (numpy) of a left-padded prefill and 3 teacher-forced decode steps (static cache)."""
    batch = len(LENGTHS)
    positions = np.maximum(np.cumsum(MASK, 1) - 1, 0)
    cache = StaticCache(MindSporeOps(), batch, WIDTH + DECODE.shape[1])
    cache.prompt_mask = ms.Tensor(MASK.astype(dtype))
    out = model(
        ms.Tensor(IDS),
        position_ids=ms.Tensor(positions),
        attention_mask=contract_mask(0, WIDTH, cache.max_length, dtype),
        past_key_values=cache,
    )
    cache.advance(WIDTH)
    logits = [out["logits"].asnumpy()]
    for step in range(DECODE.shape[1]):
        out = model(
            ms.Tensor(DECODE[:, step : step + 1]),
            position_ids=ms.Tensor(np.array(LENGTHS)[:, None] + step),
            attention_mask=contract_mask(cache.seq_length, 1, cache.max_length, dtype),
            past_key_values=cache,
            logits_to_keep=1,
        )
        cache.advance(1)
        logits.append(out["logits"].asnumpy())
    return logits


class CollectiveBytes:
    """Counts the bytes each rank hands to all_reduce / all_gather while active."""

    def __init__(self):
        self.counts = {"all_reduce": [0, 0], "all_gather": [0, 0]}  # [calls, bytes sent]
        self.originals = {name: getattr(MindSporeOps, name) for name in self.counts}

    def __enter__(self):
        for name, original in self.originals.items():

            def counted(this, x, *args, _name=name, _original=original, **kwargs):
                self.counts[_name][0] += 1
                self.counts[_name][1] += int(x.nbytes)
                return _original(this, x, *args, **kwargs)

            setattr(MindSporeOps, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(MindSporeOps, name, original)


def first_divergence(a, b, step_scores):
    """None when token arrays match; else the smallest top-1/top-2 score gap (single device) at
    a step where a row's tokens first differ: a near tie explains a float32 difference."""
    if a.shape == b.shape and np.array_equal(a, b):
        return None
    gaps = []
    for row in range(a.shape[0]):
        width = min(a.shape[1], b.shape[1])
        differ = np.flatnonzero(a[row, :width] != b[row, :width])
        if differ.size == 0:
            continue
        step = int(differ[0]) - LENGTHS[row]
        if step < 0 or step >= len(step_scores):
            return float("inf")  # the prompt itself differs: not a tie
        top = np.sort(step_scores[step][row])[-2:]
        gaps.append(float(top[1] - top[0]))
    return min(gaps) if gaps else float("inf")


def generate_checks(kind, single, sharded, dtype, sampling=True):
    scores = []

    def record(input_ids, step_scores):  # single-device per-step scores, for the tie check
        scores.append(step_scores.asnumpy())
        return step_scores

    base = GenerationConfig(max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    runs = [
        ("greedy", base),
        ("seeded", base.replace(do_sample=True, seed=11, top_k=0, temperature=0.9, cache_implementation="dynamic")),
    ]
    for name, config in runs if sampling else runs[:1]:
        scores.clear()
        want = generate(single, IDS, config.replace(logits_processor=[record]), attention_mask=MASK).asnumpy()
        # the sharded run gets the same (counted) logits_processor, so the ranks' configs agree
        got = generate(sharded, IDS, config.replace(logits_processor=[lambda i, s: s]), attention_mask=MASK).asnumpy()
        gap = first_divergence(want, got, scores)
        report(
            kind,
            f"generate-{name}-{dtype}",
            equal=gap is None,
            tie_gap=gap,
            tokens=got.tolist(),
            single_tokens=want.tolist(),
        )


# ------------------------------------------------------------------------------ checks


def check_kind(kind, path):
    full = kind in FULL_KINDS
    # a tp that does not divide the heads, or a plan that is not this process's place in the
    # group: a clear ValueError before any weight is read
    for check, plan in (("tp3", TPPlan(3, rank)), ("wrong-rank", TPPlan(2, 1 - rank))) if full else ():
        checkpoint = RecordingCheckpoint(path)
        try:
            qwen3_5.load(checkpoint, "float32", plan=plan)
            report(kind, check, error=None, reads=len(checkpoint.reads))
        except ValueError as exc:
            report(kind, check, error=str(exc), reads=len(checkpoint.reads))

    for dtype in ("float64", "float32") if full else ("float64",):
        # $HYPER_GEN_MINDSPORE_JIT (read at import) for this run: compiling the one-token blocks for every
        # batch size, dtype and checkpoint was most of this job, so they run compiled on the dense float64
        # run and PyNative, their bit-for-bit equal (test_mindspore_compiled_decode.py), on the others
        ms_compile.COMPILED_DECODE = (kind, dtype) == ("dense", "float64")
        whole_checkpoint, shard_checkpoint = RecordingCheckpoint(path), RecordingCheckpoint(path)
        single = qwen3_5.load(whole_checkpoint, dtype)
        sharded = qwen3_5.load(shard_checkpoint, dtype, plan=PLAN)
        if dtype == "float64":
            full_reads = sorted({n for n, _, whole in shard_checkpoint.reads if whole})
            split = sum(size for n, size, _ in shard_checkpoint.reads if not n.endswith(REPLICATED))
            total_split = sum(size for n, size, _ in whole_checkpoint.reads if not n.endswith(REPLICATED))
            replicated = sum(size for n, size, _ in shard_checkpoint.reads if n.endswith(REPLICATED))
            total_replicated = sum(size for n, size, _ in whole_checkpoint.reads if n.endswith(REPLICATED))
            report(
                kind,
                "reads",
                unsplit_full_reads=[n for n in full_reads if not n.endswith(REPLICATED)],
                split_elements=split,
                total_split_elements=total_split,
                replicated_elements=replicated,
                total_replicated_elements=total_replicated,
            )
            report(
                kind,
                "attributes",
                parallel_group=sharded.parallel_group,
                has_group=hasattr(sharded, "parallel_group"),
                vocab_parallel=sharded.vocab_parallel,
                vocab_size=sharded.vocab_size,
                plan=[sharded.tp_plan.tp, sharded.tp_plan.rank],
                single_parallel=hasattr(single, "parallel_group") or getattr(single, "vocab_parallel", False),
            )

        np_dtype = np.float64 if dtype == "float64" else np.float32
        want = forwards(single, np_dtype)
        with CollectiveBytes() as counter:
            got = forwards(sharded, np_dtype)
        start, stop = PLAN.vocab(VOCAB)
        real = min(stop, VOCAB) - start
        width = stop - start
        diff = max(
            float(np.abs(g[..., :real].astype(np.float64) - w[..., start : start + real]).max())
            for g, w in zip(got, want)
        )
        padding_zero = all(np.all(g[..., real:] == 0) for g in got)
        scale = max(float(np.abs(w).max()) for w in want)
        report(
            kind,
            f"logits-{dtype}",
            max_abs_diff=diff,
            max_abs_logit=scale,
            shard_width=int(got[0].shape[-1]),
            expected_width=width,
            padding_zero=bool(padding_zero),
            collectives=counter.counts,
            forwards=1 + DECODE.shape[1],
        )

        if full and dtype == "float32":
            # bytes per decode step, measured on one step of a batch of 3
            cache = StaticCache(MindSporeOps(), len(LENGTHS), 2)
            sharded(ms.Tensor(IDS[:, :1]), past_key_values=cache)
            cache.advance(1)
            with CollectiveBytes() as step:
                sharded(ms.Tensor(IDS[:, 1:2]), past_key_values=cache)
            report(kind, "decode-step-bytes", batch=len(LENGTHS), collectives=step.counts)
        generate_checks(kind, single, sharded, dtype, sampling=full)


for kind_name, checkpoint_path in CHECKPOINTS.items():
    check_kind(kind_name, checkpoint_path)

# what the native MindSpore CPU collectives do with float64 (why the model moves float64 as bits)
x = ms.Tensor(np.array([[1 / 3 + rank, np.pi]], np.float64))
gathered = MindSporeOps().all_gather(x).asnumpy()
report(
    "collectives",
    "float64-allgather",
    exact=bool(np.array_equal(gathered[rank], x.asnumpy()[0])),
    dtype=str(MindSporeOps().all_gather(x).dtype),
)
try:
    MindSporeOps().all_reduce(x)
    report("collectives", "float64-allreduce", error=None)
except (TypeError, RuntimeError, ValueError) as exc:
    report("collectives", "float64-allreduce", error=f"{type(exc).__name__}: {str(exc)[:200]}")
print(f"rank {rank}: done", flush=True)
