"""Context-parallel native torch Qwen3.5 (``load_model(..., tp=T, cp=world/T)``) against the same
checkpoint on one device (rank 0 also loads it whole and shares its outputs by broadcast: only one
rank pays for the reference, each compares its own; the other ranks' tokens must be rank 0's).
Prints one line per check, ``rank R: <check> <label> ...``; it never raises on a failed comparison
(a rank that stopped early would leave the others hanging in a collective): tests/test_cp_torch.py
reads the lines.

usage: cp_torch.py TP LABEL=CHECKPOINT_DIR ...
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch_exit import exit_past_teardown  # this folder: on sys.path as the script's

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.backends.torch.ops import TorchOps
from hyper_gen.cache import DynamicCache, StaticCache

torch.set_num_threads(1)
TP = int(sys.argv[1])
CP = int(os.environ["WORLD_SIZE"]) // TP
checkpoints = [arg.split("=", 1) for arg in sys.argv[2:]]
WIDTHS = (70, 200)  # neither a multiple of the 64-position chunk nor of the rank count
SHORT_WIDTHS = (1, 65, 129)  # shorter than the ranks; a one-position last slice (conv halo over 1 row)
DECODE_STEPS = 4
ATTENTION_LAYERS = (1, 3)


def say(line):
    """One write per line: the ranks share the launcher's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


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


def contract_mask(prompt_mask, past, seq, total, dtype):
    batch, prompt_len = prompt_mask.shape
    real = torch.ones(batch, total, dtype=torch.bool)
    real[:, :prompt_len] = prompt_mask.bool()
    visible = (torch.arange(total)[None, :] <= torch.arange(past, past + seq)[:, None])[None] & real[:, None, :]
    return torch.zeros(batch, 1, seq, total, dtype=dtype).masked_fill(~visible[:, None], torch.finfo(dtype).min)


def contract_run(model, ids, prompt_mask, decode_ids, cache_class):
    """Prefill (every position's logits), then one teacher-forced decode step per column of
    decode_ids: every call's logits, and the cache."""
    batch, width = ids.shape
    cache = cache_class(TorchOps("cpu"), batch, width + decode_ids.shape[1])
    cache.prompt_mask = prompt_mask.to(model.dtype)
    total = (lambda seq: cache.max_length) if cache.is_static else (lambda seq: cache.seq_length + seq)
    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0) * prompt_mask
    lengths = prompt_mask.sum(1)
    with torch.no_grad():
        mask = contract_mask(prompt_mask, 0, width, total(width), model.dtype)
        out = model(ids, position_ids=positions, attention_mask=mask, past_key_values=cache)["logits"]
        outs = [out * prompt_mask[..., None]]
        cache.advance(width)
        cache.prompt_mask = None
        for step in range(decode_ids.shape[1]):
            mask = contract_mask(prompt_mask, cache.seq_length, 1, total(1), model.dtype)
            out = model(
                decode_ids[:, step : step + 1],
                position_ids=(lengths + step)[:, None],
                attention_mask=mask,
                past_key_values=cache,
                logits_to_keep=1,
            )["logits"]
            outs.append(out)
            cache.advance(1)
    return outs, cache


def shared_reference(reference, ours):
    """Rank 0's single-device outputs (``reference``; None elsewhere) on every rank, broadcast in
    the shapes of this rank's ``ours`` (a reference of other shapes arrives as inf: the check fails)."""
    shared = []
    for i, mine in enumerate(ours):
        buf = torch.full_like(mine, float("inf"))
        if reference is not None and len(reference) == len(ours) and reference[i].shape == mine.shape:
            buf = reference[i].to(mine.dtype).contiguous()
        dist.broadcast(buf, src=0)
        shared.append(buf)
    return shared


def single_tokens(single, ids, cfg, mask, got):
    """Whether ``got`` is the single-device run's tokens, on rank 0 (the one holding the model whole); "-" elsewhere."""
    return "-" if single is None else np.array_equal(got, generate(single, ids, cfg, attention_mask=mask).numpy())


def expected_kv_length(model, width, cache):
    """What this rank's cache must hold per attention layer: its slice (the owner: + decode)."""
    plan = model.cp_plan
    layout = plan.layout(width)
    if cache.is_static:
        return layout.static_capacity(plan.rank, cache.max_length)
    start, stop = layout.cached_columns(plan.rank, cache.seq_length)
    return stop - start


rank = model = None
for label, path in checkpoints:
    for dtype in ("float32", "float64"):
        model = load_model(path, backend="torch", dtype=dtype, tp=TP, cp=CP)
        rank = dist.get_rank()
        single = load_model(path, backend="torch", dtype=dtype) if rank == 0 else None
        tag = f"rank {rank}: {{}} {label}/{dtype}"
        say(
            tag.format("attributes") + f" group={model.parallel_group} vocab_parallel={model.vocab_parallel} "
            f"cp_plan={model.cp_plan} tp_plan={model.tp_plan}"
        )
        for width in WIDTHS:
            ids, mask, decode_ids = padded_batch(model.vocab_size, width)
            t_ids, t_mask, t_decode = (torch.from_numpy(a) for a in (ids, mask, decode_ids))
            diff, kv_ok, kv_lengths = 0.0, True, []
            for cache_class in (StaticCache, DynamicCache):
                ours, cache = contract_run(model, t_ids, t_mask, t_decode, cache_class)
                reference = (
                    contract_run(single, t_ids, t_mask, t_decode, cache_class)[0] if single is not None else None
                )
                reference = shared_reference(reference, ours)
                diff = max(diff, max((a.double() - b.double()).abs().max().item() for a, b in zip(ours, reference)))
                want = expected_kv_length(model, width, cache)
                got = [cache.keys[i].shape[2] if i in cache.keys else 0 for i in ATTENTION_LAYERS]
                got += [cache.values[i].shape[2] if i in cache.values else 0 for i in ATTENTION_LAYERS]
                kv_ok &= all(n == want for n in got) and want < cache.max_length
                kv_lengths.append((cache_class.__name__, got[0], want, cache.max_length))
            say(tag.format("logits") + f" width={width} maxdiff={diff:.3e}")
            say(tag.format("kvshard") + f" width={width} ok={kv_ok} lengths={kv_lengths}")

        greedy = GenerationConfig(max_new_tokens=8, eos_token_id=None, pad_token_id=0)
        seeded = greedy.replace(do_sample=True, seed=11, top_k=0, temperature=1.3)
        runs = [("greedy", greedy), ("seeded", seeded), ("dynamic", greedy.replace(cache_implementation="dynamic"))]
        runs += [("recompute", greedy.replace(max_new_tokens=3, use_cache=False))]
        runs += [("repeated", seeded.replace(num_return_sequences=2))]
        for width in WIDTHS + SHORT_WIDTHS:
            ids, mask, _ = padded_batch(model.vocab_size, width)
            for name, cfg in runs:
                if name in ("recompute", "repeated") and width not in WIDTHS[:1]:
                    continue
                got = generate(model, ids, cfg, attention_mask=mask).numpy()
                equal = single_tokens(single, ids, cfg, mask, got)
                say(tag.format(name) + f" width={width} equal={equal} tokens={got.tolist()}")

        # the Ulysses all-to-all strategy for full-attention prefill: the same checks, the same tokens
        utag = f"rank {rank}: {{}} {label}/{dtype}/ulysses"
        try:
            ulysses = load_model(path, backend="torch", dtype=dtype, tp=TP, cp=CP, cp_strategy="ulysses")
        except ValueError as exc:  # tp=2 leaves 1 KV head per tp rank: not divisible by cp=2
            say(utag.format("load") + f" ValueError: {exc}")
            continue
        say(utag.format("load") + f" cp_plan={ulysses.cp_plan}")
        for width in WIDTHS:
            ids, mask, decode_ids = padded_batch(model.vocab_size, width)
            t_ids, t_mask, t_decode = (torch.from_numpy(a) for a in (ids, mask, decode_ids))
            diff, kv_ok = 0.0, True
            for cache_class in (StaticCache, DynamicCache):
                ours, cache = contract_run(ulysses, t_ids, t_mask, t_decode, cache_class)
                reference = (
                    contract_run(single, t_ids, t_mask, t_decode, cache_class)[0] if single is not None else None
                )
                reference = shared_reference(reference, ours)
                diff = max(diff, max((a.double() - b.double()).abs().max().item() for a, b in zip(ours, reference)))
                want = expected_kv_length(ulysses, width, cache)
                kv_ok &= all(cache.keys[i].shape[2] == want for i in ATTENTION_LAYERS) and want < cache.max_length
            say(utag.format("logits") + f" width={width} maxdiff={diff:.3e}")
            say(utag.format("kvshard") + f" width={width} ok={kv_ok}")
            for name, cfg in runs[:3]:
                got = generate(ulysses, ids, cfg, attention_mask=mask).numpy()
                equal = single_tokens(single, ids, cfg, mask, got)
                say(utag.format(name) + f" width={width} equal={equal} tokens={got.tolist()}")
        del ulysses

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
out = generate(model, ids, cfg, attention_mask=mask).numpy()  # the ranks are still in step afterwards
say(f"rank {rank}: after-mismatch tokens={out.tolist()}")

try:
    load_model(checkpoints[0][1], backend="torch", tp=TP, cp=4)
    say(f"rank {rank}: world NO ERROR")
except ValueError as exc:
    say(f"rank {rank}: world ValueError: {exc}")
dist.destroy_process_group()
exit_past_teardown()
