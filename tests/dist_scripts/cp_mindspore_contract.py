"""The cache-object contract driven by hand for the MindSpore context-parallel scripts
(cp_mindspore.py, cp_tp_mindspore.py): the additive mask of a left-padded batch, and a prefill
followed by teacher-forced decode steps."""

import mindspore as ms
import numpy as np

from hyper_gen import generate
from hyper_gen.backends.mindspore.ops import MindSporeOps

REFERENCE_RANK = 0  # the one rank that also runs the model whole (the single-device reference)


def shared_reference(ops, rank, reference, ours):
    """The reference rank's single-device outputs (``reference``; None elsewhere) on every rank:
    only that rank pays for running the model whole (the others wait in this all-gather, which does
    not spin), and each rank still compares its own outputs. They travel as raw int32 words, exact
    for float64 too. A reference of other shapes than ``ours`` arrives as inf, so the comparison fails."""
    fits = reference is not None and len(reference) == len(ours)
    fits = fits and all(a.shape == b.shape for a, b in zip(reference, ours))
    shared = []
    for i, mine in enumerate(ours):
        words = np.zeros_like(mine)
        if rank == REFERENCE_RANK:
            words = reference[i].astype(mine.dtype) if fits else words + np.inf
        gathered = ops.to_numpy(ops.all_gather(ops.asarray(np.ascontiguousarray(words).view(np.int32)), axis=0))
        shared.append(gathered[: mine.shape[0]].view(mine.dtype).reshape(mine.shape))
    return shared


def single_tokens(single, ids, cfg, mask, got):
    """Whether ``got`` is the single-device run's tokens, on the reference rank (the one holding the
    model whole); "-" elsewhere."""
    if single is None:
        return "-"
    return np.array_equal(got, generate(single, ids, cfg, attention_mask=mask).asnumpy())


def contract_mask(prompt_mask, past, seq, total, dtype):
    batch, width = prompt_mask.shape
    real = np.ones((batch, total), bool)
    real[:, :width] = prompt_mask.astype(bool)
    visible = (np.arange(total)[None, :] <= np.arange(past, past + seq)[:, None])[None] & real[:, None, :]
    return ms.Tensor(np.where(visible, 0.0, np.finfo(dtype).min).astype(dtype)[:, None])


def contract_run(model, ids, prompt_mask, decode_ids, cache_class, dtype):
    """Prefill (every position's logits), then one teacher-forced decode step per column of
    decode_ids (the tokens one device generated): every call's logits (numpy), and the cache."""
    batch, width = ids.shape
    cache = cache_class(MindSporeOps(), batch, width + decode_ids.shape[1])
    cache.prompt_mask = ms.Tensor(prompt_mask.astype(dtype))
    total = (lambda seq: cache.max_length) if cache.is_static else (lambda seq: cache.seq_length + seq)
    positions = np.maximum(np.cumsum(prompt_mask, 1) - 1, 0) * prompt_mask
    lengths = prompt_mask.sum(1)
    out = model(
        ms.Tensor(ids),
        position_ids=ms.Tensor(positions),
        attention_mask=contract_mask(prompt_mask, 0, width, total(width), dtype),
        past_key_values=cache,
    )["logits"].asnumpy()
    outs = [out * prompt_mask[..., None]]
    cache.advance(width)
    cache.prompt_mask = None
    for step in range(decode_ids.shape[1]):
        out = model(
            ms.Tensor(decode_ids[:, step : step + 1]),
            position_ids=ms.Tensor((lengths + step)[:, None]),
            attention_mask=contract_mask(prompt_mask, cache.seq_length, 1, total(1), dtype),
            past_key_values=cache,
            logits_to_keep=1,
        )["logits"].asnumpy()
        outs.append(out)
        cache.advance(1)
    return outs, cache
