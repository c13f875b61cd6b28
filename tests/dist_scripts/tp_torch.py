"""Two ranks: native torch Qwen3.5 at TP=2 against the same checkpoint on one device (each rank
also loads it whole). Prints one line per check, ``rank R: <check> <label> ...``; it never raises
on a failed comparison (a rank that stopped early would leave the other hanging in a collective):
tests/test_tp_torch.py reads the lines.

usage: tp_torch.py LABEL=CHECKPOINT_DIR ...
"""

import sys

import numpy as np
import torch
import torch.distributed as dist
from torch_exit import exit_past_teardown  # this folder: on sys.path as the script's

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.backends.torch.ops import TorchOps
from hyper_gen.cache import DynamicCache, StaticCache
from hyper_gen.models import qwen3_5 as qwen3_5_family
from hyper_gen.models.checkpoint import Checkpoint
from hyper_gen.models.qwen3_5.tp_traffic import collective_bytes_per_decode_step, decode_step_collectives

torch.set_num_threads(1)
checkpoints = [arg.split("=", 1) for arg in sys.argv[1:]]
# a left-padded batch: a 70-token prompt (two delta-rule chunks), a 3-token and a 17-token one
LENGTHS = (70, 3, 17)
DECODE_STEPS = 4
REPLICATED = ("norm.weight", "layernorm.weight", "mlp.gate.weight", "shared_expert_gate.weight")


def say(line):
    """One write per line: the two ranks share the launcher's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def padded_batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    width = max(LENGTHS)
    ids = np.zeros((len(LENGTHS), width), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, width - n :] = rng.integers(1, vocab, n)
        mask[row, width - n :] = 1
    return ids, mask, rng.integers(1, vocab, (len(LENGTHS), DECODE_STEPS))


def full_vocab(model, logits):
    """The whole vocabulary: a vocab-parallel model's blocks all-gathered, padding trimmed."""
    if not getattr(model, "vocab_parallel", False):
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts, -1)[..., : model.vocab_size]


def contract_mask(prompt_mask, past, seq, total, dtype):
    batch, prompt_len = prompt_mask.shape
    real = torch.ones(batch, total, dtype=torch.bool)
    real[:, :prompt_len] = prompt_mask.bool()
    visible = (torch.arange(total)[None, :] <= torch.arange(past, past + seq)[:, None])[None] & real[:, None, :]
    return torch.zeros(batch, 1, seq, total, dtype=dtype).masked_fill(~visible[:, None], torch.finfo(dtype).min)


def contract_run(model, ids, prompt_mask, decode_ids, cache_class):
    """Prefill, then one teacher-forced decode step per column of decode_ids: every call's logits."""
    batch, width = ids.shape
    cache = cache_class(TorchOps("cpu"), batch, width + decode_ids.shape[1])
    cache.prompt_mask = prompt_mask.to(model.dtype)
    total = (lambda seq: cache.max_length) if cache.is_static else (lambda seq: cache.seq_length + seq)
    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0) * prompt_mask
    lengths = prompt_mask.sum(1)
    with torch.no_grad():
        mask = contract_mask(prompt_mask, 0, width, total(width), model.dtype)
        outs = [
            full_vocab(model, model(ids, position_ids=positions, attention_mask=mask, past_key_values=cache)["logits"])
            * prompt_mask[..., None]
        ]
        cache.advance(width)
        for step in range(decode_ids.shape[1]):
            mask = contract_mask(prompt_mask, cache.seq_length, 1, total(1), model.dtype)
            out = model(
                decode_ids[:, step : step + 1],
                position_ids=(lengths + step)[:, None],
                attention_mask=mask,
                past_key_values=cache,
                logits_to_keep=1,
            )["logits"]
            outs.append(full_vocab(model, out))
            cache.advance(1)
    return outs


def audited_tp_load(path, dtype):
    """load_model(tp=2), recording every tensor read: whole tensors must be replicated weights,
    and every slice must be less than the whole axis."""
    reads = []
    get, get_slice = Checkpoint.get, Checkpoint.get_slice

    def whole(self, name, *args, **kwargs):
        reads.append((name, None))
        return get(self, name, *args, **kwargs)

    def part(self, name, axis, start, stop, *args, **kwargs):
        reads.append((name, (start, stop, self.shape(name)[axis])))
        return get_slice(self, name, axis, start, stop, *args, **kwargs)

    Checkpoint.get, Checkpoint.get_slice = whole, part
    try:
        model = load_model(path, backend="torch", dtype=dtype, tp=2)
    finally:
        Checkpoint.get, Checkpoint.get_slice = get, get_slice
    split_read_whole = sorted({n for n, window in reads if window is None and not n.endswith(REPLICATED)})
    full_slices = sorted({n for n, window in reads if window is not None and window[1] - window[0] >= window[2]})
    return model, split_read_whole, full_slices


def counted_decode_step(model, ids, mask, cfg):
    """(kind, bytes) of every collective between the 2nd and 3rd token of a generate() call."""
    log, marks = [], []
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def reduce(tensor, *args, **kwargs):
        log.append(("all_reduce", tensor.numel() * tensor.element_size()))
        return all_reduce(tensor, *args, **kwargs)

    def gather(parts, tensor, *args, **kwargs):
        log.append(("all_gather", tensor.numel() * tensor.element_size()))
        return all_gather(parts, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = reduce, gather
    try:
        generate(model, ids, cfg, attention_mask=mask, on_tokens=lambda step, tokens, done: marks.append(len(log)))
    finally:
        dist.all_reduce, dist.all_gather = all_reduce, all_gather
    return log[marks[1] : marks[2]]


rank = None
for label, path in checkpoints:
    for dtype in ("float32", "float64"):
        tp_model, split_read_whole, full_slices = audited_tp_load(path, dtype)
        rank = dist.get_rank()
        single = load_model(path, backend="torch", dtype=dtype)
        tag = f"rank {rank}: {{}} {label}/{dtype}"
        say(
            tag.format("attributes") + f" group={tp_model.parallel_group} vocab_parallel={tp_model.vocab_parallel} "
            f"vocab_size={tp_model.vocab_size} plan={tp_model.tp_plan} "
            f"single_is_local={not hasattr(single, 'parallel_group')}"
        )
        say(tag.format("reads") + f" split_read_whole={split_read_whole} full_slices={full_slices}")

        ids, mask, decode_ids = padded_batch(single.vocab_size)
        t_ids, t_mask, t_decode = (torch.from_numpy(a) for a in (ids, mask, decode_ids))
        # float32 is also measured against the float64 model: the chunked delta rule turns float32
        # rounding into ~1e-4 at prefill on one device too, so TP's error is judged against that
        truth = single if dtype == "float64" else load_model(path, backend="torch", dtype="float64")
        diffs = {"maxdiff": 0.0, "tp_vs_f64": 0.0, "single_vs_f64": 0.0}
        for cache_class in (StaticCache, DynamicCache):
            ours = contract_run(tp_model, t_ids, t_mask, t_decode, cache_class)
            reference = contract_run(single, t_ids, t_mask, t_decode, cache_class)
            exact = contract_run(truth, t_ids, t_mask, t_decode, cache_class)
            for key, (x, y) in (
                ("maxdiff", (ours, reference)),
                ("tp_vs_f64", (ours, exact)),
                ("single_vs_f64", (reference, exact)),
            ):
                diffs[key] = max(diffs[key], max((a.double() - b.double()).abs().max().item() for a, b in zip(x, y)))
        say(tag.format("logits") + " " + " ".join(f"{key}={value:.3e}" for key, value in diffs.items()))

        greedy = GenerationConfig(max_new_tokens=8, eos_token_id=None, pad_token_id=0)
        seeded = greedy.replace(do_sample=True, seed=11, top_k=0, temperature=1.3)
        for name, cfg in (("greedy", greedy), ("seeded", seeded)):
            got = generate(tp_model, ids, cfg, attention_mask=mask).numpy()
            want = generate(single, ids, cfg, attention_mask=mask).numpy()
            say(tag.format(name) + f" equal={np.array_equal(got, want)} tokens={got.tolist()}")

        calls = counted_decode_step(tp_model, ids, mask, greedy)
        expected = decode_step_collectives(tp_model.config, len(LENGTHS), 2, tp_model.dtype.itemsize)
        counted = {
            kind: (sum(1 for k, _ in calls if k == kind), sorted({b for k, b in calls if k == kind}))
            for kind in ("all_reduce", "all_gather")
        }
        matches = all(counted[kind] == (n, [size]) for kind, (n, size) in expected.items())
        say(
            tag.format("traffic") + f" match={matches} counted={counted} expected={expected} bytes_per_rank="
            f"{collective_bytes_per_decode_step(tp_model.config, len(LENGTHS), 2, tp_model.dtype.itemsize):.0f}"
        )

# tp must be the job's world size (the tiny configs split only at tp 1 and 2, so the plan check,
# which would fail first, is bypassed here)
check = qwen3_5_family.check_tp
qwen3_5_family.check_tp = lambda plan, config: None
try:
    load_model(checkpoints[0][1], backend="torch", tp=4)
    say(f"rank {rank}: world NO ERROR")
except ValueError as exc:
    say(f"rank {rank}: world ValueError: {exc}")
finally:
    qwen3_5_family.check_tp = check

# a rank handed a different prompt: ValueError on both ranks, no hang
ids, mask, _ = padded_batch(tp_model.vocab_size)
different = ids.copy()
different[0, -1] = different[0, -1] % (tp_model.vocab_size - 1) + 1
cfg = GenerationConfig(max_new_tokens=3, eos_token_id=None)
try:
    generate(tp_model, different if rank == 1 else ids, cfg, attention_mask=mask)
    say(f"rank {rank}: mismatch NO ERROR")
except ValueError as exc:
    say(f"rank {rank}: mismatch ValueError: {exc}")
# the ranks are still in step afterwards
out = generate(tp_model, ids, cfg, attention_mask=mask).numpy()
say(f"rank {rank}: after-mismatch tokens={out.tolist()}")
dist.destroy_process_group()
exit_past_teardown()
