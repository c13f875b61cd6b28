"""``score()``: each token's log-probability under the model, by teacher forcing in one forward.

What an RL trainer recomputes after a rollout (the policy's logprobs of the sampled tokens, a
reference model's for the KL term), and what vLLM returns as ``prompt_logprobs``. The forward is
the one generate's ``use_cache=False`` recompute makes (drivers.py: the same ids, positions, mask
and contract for native, RFC and HF models), with every position's logits kept; the log-softmax
is generate's ``raw_logprobs``' (float32, or float64 for float64 logits).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .config import GenerationConfig
from .drivers import make_driver
from .inputs import InputTypeError, ModelLimits, PromptBatch, _as_2d_int, _first
from .parallel.model_group import (
    check_consistent_inputs,
    exclusive,
    forward_is_collective,
    gather_vocab_logits,
    model_group_leader,
)
from .parallel.step_sync import StepSync
from .registry import backend_for, to_host
from .sampling import log_softmax


def score(model, sequences, attention_mask=None, prompt_lengths=None):
    """Per-token log-probabilities of ``sequences`` under ``model``, in one forward.

    ``sequences``: (B, T) token ids (a framework tensor, numpy array or list of lists), T >= 2.
    ``attention_mask``: (B, T) 1 = real token, 0 = padding; each row's real tokens are one run, so
    padding may be on the left (a tokenizer's ``padding_side="left"``), on the right (generate's
    returned ``sequences``: ``[prompt | generated | pad]``) or both. None = every token is real.
    Positions are those generate gives a left-padded row (0 at its first real token).
    ``prompt_lengths``: (B,) ints, the real prompt tokens of each row (generate's
    ``out.prompt_lengths``), 1 <= prompt_lengths[i] <= the row's real tokens; only the tokens after
    a row's prompt are then scored.

    Returns a (B, T) tensor of the model's framework, aligned with ``sequences``: element [i, t] is
    ``log p(sequences[i, t] | the row's real tokens before t)``, float32, or float64 where the model's
    logits are float64. Where nothing is scored it holds 0.0, as generate's logprobs do past a row's
    end: at each row's first real token (it has no context), at padding, and inside the prompt when
    ``prompt_lengths`` is given. ``[:, 1:]`` is the usual (B, T - 1) shifted layout. For a
    ``generate(..., return_dict_in_generate=True, output_logprobs=True)`` output ``out``::

        total = out.prompt_lengths + out.generated_lengths
        mask = np.arange(out.sequences.shape[1])[None, :] < total[:, None]
        lp = score(model, out.sequences, mask, out.prompt_lengths)
        # lp[i, p : p + n] equals out.raw_logprobs[i, :n] for p, n = out.prompt_lengths[i], out.generated_lengths[i]

    Bad input (wrong rank or shape, a mask that is not one run of ones, ids outside the vocabulary the
    model declares, prompt_lengths out of range, a row longer than the model's context) raises
    ``ValueError`` / ``TypeError`` naming the field, before the forward.

    Split models: every rank of a model-parallel group (``load_model(..., tp=N)``, a model declaring
    ``parallel_group``) calls it with the same arguments (checked, as generate checks them) and gets
    the same logprobs, the whole vocabulary's. A model whose forward runs collectives across the job
    (FSDP2 ``fully_shard``, ZeRO-3, DTensor: generate's step-synced kind) needs every rank of the job
    to call it once, each with its own batch (of any size) or the same one; its parameters are
    gathered once per layer in that one forward, so there is no ``unshard_params``. On either kind a
    rank whose input is refused raises its error and every other rank a ``ValueError`` naming that
    rank, before any forward, instead of waiting for it in a collective.
    """
    return _score(model, sequences, attention_mask, prompt_lengths)[0]


def prompt_top_logprobs(model, prompt_ids, k: int):
    """vLLM's ``prompt_logprobs=k`` of one prompt, in ``score``'s one forward: (chosen, values, ids, ranks), host numpy.

    ``chosen`` (T - 1,): ``score(model, [prompt_ids])[0, 1:]``, each prompt token's logprob given the
    tokens before it; ``values`` / ``ids`` (T - 1, min(k, V)): the ``k`` largest of that position's
    log-softmax, largest first (None for k = 0); ``ranks`` (T - 1,): each prompt token's rank there
    (1 + the tokens strictly likelier, vLLM's). A one-token prompt has nothing to score: empty arrays,
    no forward. Every rank of a multi-rank model calls it with the same arguments."""
    prompt_ids = [int(t) for t in prompt_ids]
    if len(prompt_ids) < 2:
        none = (np.zeros((0, 0), dtype=np.float32), np.zeros((0, 0), dtype=np.int64)) if k else (None, None)
        return (np.zeros(0, dtype=np.float32), *none, np.zeros(0, dtype=np.int64))
    return _score(model, [prompt_ids], None, None, top=int(k))


def _score(model, sequences, attention_mask, prompt_lengths, top=None):
    """``score``'s tensor; with ``top`` (an int) instead row 0's host (T - 1,) picked logprobs and the
    top-``top`` (values, ids) of each of its positions (None, None for 0)."""
    if model is None or not callable(model):
        raise TypeError(f"model must be a callable model (torch.nn.Module / mindspore.nn.Cell), got {model!r}")
    ops = backend_for(model, sequences)
    sync = _rank_sync(ops, model)
    config = GenerationConfig(max_new_tokens=1, use_cache=False, eos_token_id=None)
    try:
        ids, scored, prompt, given, extra = _checked_inputs(model, sequences, attention_mask, prompt_lengths)
    except Exception as error:
        # the other ranks of a split model must not wait in a collective for a rank that refused its input
        if sync is not None:
            sync.start(error, 0)
        else:
            check_consistent_inputs(ops, model, None, None, extra=_UNCHECKED, error=error, caller="score()")
        raise
    if sync is not None:
        sync.start(None, ids.shape[0])
        try:  # every rank's input is valid: now a model-parallel group compares its ranks' inputs
            check_consistent_inputs(ops, model, given, config, extra=extra, caller="score()")
        except Exception as error:
            sync.agree(error)
            raise
        sync.agree(None)
    else:
        check_consistent_inputs(ops, model, given, config, extra=extra, caller="score()")
    batch, width = ids.shape
    limits = ModelLimits.of(model)
    driver = make_driver(model, ops, prompt, config, ops.param_dtype(model))
    with exclusive(ops, model), ops.no_grad():
        logits = gather_vocab_logits(ops, model, driver.all_logits())
        if tuple(int(n) for n in logits.shape[:2]) != (batch, width):
            raise ValueError(
                f"{type(model).__name__} returned logits of shape {tuple(logits.shape)} for sequences of shape "
                f"{(batch, width)}: score() needs every position's logits (B, T, V)"
            )
        if limits.vocab_size is None:  # undeclared: the logits tell
            _check_ids(ids, int(logits.shape[-1]), "the width of its logits")
        dtype = "float64" if ops.dtype_name(logits) == "float64" else "float32"
        logprobs = log_softmax(ops, ops.cast(logits[:, :-1], dtype))
        following = ops.asarray(ids[:, 1:, None], "int64")
        picked = ops.take_along_axis(logprobs, following, -1)[:, :, 0]  # (B, T - 1): token t + 1 given <= t
        if top is not None:
            return _top_of(ops, logprobs[0], picked[0], top)
        picked = ops.concat([ops.zeros((batch, 1), dtype), picked], 1)
        return ops.where(ops.asarray(scored, "bool"), picked, 0.0), None, None, None


def position_top_logprobs(ops, logits, following: np.ndarray, k: int):
    """``prompt_top_logprobs``' host arrays from (T, V) logits already computed (the engine's prefill
    chunks): position t's distribution scores token ``following[t]``."""
    dtype = "float64" if ops.dtype_name(logits) == "float64" else "float32"
    logprobs = log_softmax(ops, ops.cast(logits, dtype))
    picked = ops.take_along_axis(logprobs, ops.asarray(following[:, None], "int64"), -1)[:, 0]
    return _top_of(ops, logprobs, picked, int(k))


def _top_of(ops, logprobs, picked, top: int):
    """(chosen, top values, top ids, ranks) on the host of (T, V) ``logprobs`` and the (T,) ``picked``."""
    values = ids_top = None
    if top:
        values, ids_top = ops.topk(logprobs, min(top, int(logprobs.shape[-1])))
        values, ids_top = ops.to_numpy(values), ops.to_numpy(ids_top).astype(np.int64)
    above = ops.cast(logprobs > picked[:, None], "float32")  # tokens likelier than the prompt's
    ranks = ops.to_numpy(ops.sum(above, -1)).astype(np.int64) + 1
    return ops.to_numpy(picked), values, ids_top, ranks


_UNCHECKED = (("prompt_lengths", b""),)  # the extra fields score() compares across ranks, unset


def _rank_sync(ops, model):
    """generate()'s step sync, for a model whose forward runs collectives across the job (FSDP, ZeRO-3,
    DTensor): every rank learns before the forward whether every rank's input was valid; None elsewhere."""
    if ops.world_size() == 1 or not forward_is_collective(ops, model):
        return None
    return StepSync(ops, model_group_leader(ops, model), caller="score()", before="before the forward")


def _checked_inputs(model, sequences, attention_mask, prompt_lengths):
    """(ids, scored (B, T) bool, the forward's PromptBatch, the ids and mask as given (what the ranks of a
    split model compare), the extra (name, bytes) fields they compare), or ValueError / TypeError."""
    ids, mask, starts = _checked_sequences(sequences, attention_mask)
    batch, width = ids.shape
    lengths = mask.sum(axis=1)
    scored = np.zeros((batch, width), dtype=bool)
    scored[:, 1:] = (mask[:, 1:] == 1) & (mask[:, :-1] == 1)  # a real token after a real token
    prompts = None
    if prompt_lengths is not None:
        prompts = _checked_prompt_lengths(prompt_lengths, batch, lengths)
        scored &= np.arange(width)[None, :] >= (starts + prompts)[:, None]
    limits = ModelLimits.of(model)
    if limits.vocab_size is not None:
        _check_ids(ids, limits.vocab_size, "vocab_size")
    if limits.context is not None and int(lengths.max()) > limits.context:
        row = int(np.argmax(lengths))
        raise ValueError(
            f"sequences row {row} has {int(lengths[row])} real tokens, more than the model's context of "
            f"{limits.context} positions (max_position_embeddings)"
        )
    # the forward sees each row from its first real token on: trailing padding is fed as tokens (a causal
    # model's earlier positions cannot see it) and its scores dropped
    forward_mask = (np.cumsum(mask, axis=1) > 0).astype(np.int64)
    prompt = PromptBatch(ids=ids, mask=forward_mask, lengths=forward_mask.sum(axis=1), padded=bool((starts > 0).any()))
    given = PromptBatch(ids=ids, mask=mask, lengths=lengths, padded=prompt.padded)
    extra = (("prompt_lengths", b"" if prompts is None else b"1" + prompts.tobytes()),)
    return ids, scored, prompt, given, extra


def _checked_sequences(sequences: Any, attention_mask: Any):
    """(ids (B, T) int64, mask (B, T) int64, each row's first real column (B,))."""
    host = to_host(sequences)
    if isinstance(host, np.ndarray) and host.dtype.kind in "fc":
        raise InputTypeError(f"sequences must hold integers (token ids), got dtype {host.dtype}")
    ids = _as_2d_int("sequences", host)
    if ids.shape[1] < 2:
        raise ValueError(
            f"sequences must have at least 2 tokens per row (the first has no context to score it from), "
            f"got shape {ids.shape}"
        )
    negative = ids < 0
    if negative.any():
        row, col = _first(negative)
        raise ValueError(
            f"sequences must be non-negative token ids, got sequences[{row}, {col}] = {int(ids[row, col])}"
        )
    if attention_mask is None:
        return ids, np.ones_like(ids), np.zeros(ids.shape[0], dtype=np.int64)
    mask = _as_2d_int("attention_mask", attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} != sequences shape {ids.shape}")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
    empty = np.flatnonzero(mask.sum(axis=1) == 0)
    if empty.size:
        raise ValueError(f"attention_mask row {int(empty[0])} has no real token")
    rises = (np.diff(mask, axis=1) > 0).sum(axis=1) + mask[:, 0]  # runs of ones per row
    broken = np.flatnonzero(rises > 1)
    if broken.size:
        raise ValueError(
            f"attention_mask row {int(broken[0])} has padding between real tokens: a row's real tokens must be "
            "one run (padding on the left and / or on the right)"
        )
    return ids, mask, np.argmax(mask, axis=1).astype(np.int64)


def _checked_prompt_lengths(prompt_lengths: Any, batch: int, lengths: np.ndarray) -> np.ndarray:
    host = to_host(prompt_lengths)
    try:
        values = np.asarray(host)
    except Exception as exc:
        raise TypeError(f"prompt_lengths must be (B,) ints, got {type(prompt_lengths).__name__}: {exc}") from None
    if values.dtype == bool or not (
        np.issubdtype(values.dtype, np.integer) or all(isinstance(v, numbers.Integral) for v in values.reshape(-1))
    ):
        raise TypeError(f"prompt_lengths must hold ints, got dtype {values.dtype}")
    if values.shape != (batch,):
        raise ValueError(f"prompt_lengths must have shape ({batch},), one per row of sequences, got {values.shape}")
    values = values.astype(np.int64)
    bad = np.flatnonzero((values < 1) | (values > lengths))
    if bad.size:
        row = int(bad[0])
        raise ValueError(
            f"prompt_lengths[{row}] = {int(values[row])} is out of range: row {row} has {int(lengths[row])} real "
            f"tokens, so its prompt is 1..{int(lengths[row])} of them"
        )
    return values


def _check_ids(ids: np.ndarray, vocab_size: int, source: str) -> None:
    outside = ids >= vocab_size
    if outside.any():
        row, col = _first(outside)
        raise ValueError(
            f"sequences[{row}, {col}] = {int(ids[row, col])} is not a token id of the model's vocabulary of "
            f"{vocab_size} tokens ({source}; ids 0..{vocab_size - 1}; padding ids are fed to the model too)"
        )


__all__ = ["score", "prompt_top_logprobs"]
