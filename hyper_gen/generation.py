"""``generate()``: prefill once, then one token per row per step until every row stops.

The loop is framework-free: the model driver (drivers.py) feeds the model, the selector
(sampling.py) picks tokens on the device, and the host keeps the bookkeeping (which rows are
finished, what to stream, the output). Tokens come to the host once per step, the one sync HF's
loop also makes, because stopping and streaming need them there.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .config import GenerationConfig, resolve_config
from .drivers import make_driver
from .inputs import ModelLimits, check_against_model, check_vocabulary, prepare_prompts
from .parallel.model_group import agree_on_tokens, check_consistent_inputs, exclusive, gather_vocab_logits
from .registry import backend_for
from .sampling import TokenSelector, apply_stopping_criteria

OnTokens = Callable[[int, np.ndarray, np.ndarray], Any]


def generate(
    model,
    input_ids,
    generation_config: Optional[GenerationConfig] = None,
    attention_mask=None,
    *,
    streamer=None,
    on_tokens: Optional[OnTokens] = None,
    **config_overrides,
):
    """Generate continuations of left-padded prompts with ``model``.

    ``input_ids`` / ``attention_mask``: a framework tensor, numpy array or list of lists (1 =
    real token, 0 = left padding; None = no padding). Keyword overrides update the config
    (``generate(model, ids, max_new_tokens=8)``). ``streamer``: HF streamer protocol
    (``put(ids)``, ``end()``). ``on_tokens(step, token_ids (B,), finished (B,))``: called after
    every step with host arrays.

    Returns an int64 tensor of the model's framework, (B, max_total_len): row i is its prompt
    without padding, its generated tokens (with the EOS that ended it), then ``pad_token_id``.

    Bad input raises ``ValueError`` / ``TypeError`` naming the field and value before any forward
    where the model declares what is needed (``vocab_size``, ``max_position_embeddings``, on the
    model or its ``config``): token ids, pad / EOS ids outside the vocabulary (else checked on the
    first logits' width, before the first token is chosen), a prompt that fills the context. A
    row stops where its prompt + generated tokens fill the declared context. Scores that are NaN,
    +inf or all -inf in a running row raise at that step (sampling.py).
    """
    if model is None or not callable(model):
        raise TypeError(f"model must be a callable model (torch.nn.Module / mindspore.nn.Cell), got {model!r}")
    config = resolve_config(generation_config, config_overrides, model)
    ops = backend_for(model, input_ids)
    prompt = prepare_prompts(input_ids, attention_mask)
    check_consistent_inputs(ops, model, prompt, config)
    limits = ModelLimits.of(model)  # vocab_size / max_position_embeddings, where the model declares them
    check_against_model(prompt, config, limits)  # before any forward
    dtype = ops.param_dtype(model)
    with exclusive(ops, model), ops.no_grad():  # one thread at a time where the framework needs it
        return _decode_loop(model, ops, prompt, config, dtype, streamer, on_tokens, limits)


def _decode_loop(model, ops, prompt, config, dtype, streamer, on_tokens, limits):
    batch = prompt.batch_size
    # per row: max_new_tokens, or fewer where the model's context ends (a row stops there)
    room = limits.new_token_room(prompt, config.max_new_tokens)
    capped = room < config.max_new_tokens
    steps = int(room.max())
    driver = make_driver(model, ops, prompt, _for_steps(config, steps), dtype)
    eos = np.asarray(config.eos_token_ids, dtype=np.int64)
    pad = config.pad_token_id
    needs_ids = bool(config.logits_processor or config.stopping_criteria)
    ids_view = ops.asarray(prompt.ids, "int64") if needs_ids else None
    unfinished = np.ones(batch, dtype=bool)
    generated = np.empty((batch, min(steps, 256)), dtype=np.int64)  # grows as steps happen
    new_counts = np.zeros(batch, dtype=np.int64)
    if streamer is not None:
        streamer.put(prompt.ids.copy())

    logits = driver.prefill()
    selector = None
    for step in range(steps):
        scores = ops.cast(gather_vocab_logits(ops, model, logits[:, -1]), "float32")
        if selector is None:
            if limits.vocab_size is None:  # undeclared: the logits tell, before the first token is chosen
                check_vocabulary(prompt, config, int(scores.shape[-1]), "the width of its logits")
            selector = TokenSelector(ops, config, prompt, int(scores.shape[-1]))
        tokens = selector.select(scores, step, ids_view, unfinished)
        tokens = agree_on_tokens(ops, model, config, tokens)  # framework-RNG draws: rank 0's, on every rank
        tokens = np.where(unfinished, tokens, pad)
        if step == generated.shape[1]:
            generated = _widen(generated, steps)
        generated[:, step] = tokens
        new_counts += unfinished
        if capped.any():
            unfinished &= ~(capped & (new_counts >= room))
        tokens_device = ops.asarray(tokens[:, None], "int64")
        selector.observe(tokens_device)
        if needs_ids:
            ids_view = ops.concat([ids_view, tokens_device], 1)
        if eos.size:
            unfinished &= ~np.isin(tokens, eos)
        stop = apply_stopping_criteria(config.stopping_criteria, ids_view, scores, batch)
        if stop is not None:
            unfinished &= ~stop
        if streamer is not None:
            streamer.put(tokens.copy())
        if on_tokens is not None:
            on_tokens(step, tokens.copy(), ~unfinished)
        if not unfinished.any() or step + 1 == steps:
            break
        logits = driver.decode(tokens, tokens_device)
    if streamer is not None:
        streamer.end()
    return ops.asarray(_assemble(prompt, generated, new_counts, pad), "int64")


def _for_steps(config, steps: int):
    """The config the driver sizes its buffers (static cache, masks) from: at most ``steps`` tokens."""
    if steps == config.max_new_tokens:
        return config
    return config.replace(max_new_tokens=steps, min_new_tokens=min(config.min_new_tokens, steps))


def _widen(buffer: np.ndarray, limit: int) -> np.ndarray:
    """``buffer`` (B, n) with twice the columns (at most ``limit``), its contents kept."""
    wider = np.empty((buffer.shape[0], min(limit, 2 * buffer.shape[1])), dtype=buffer.dtype)
    wider[:, : buffer.shape[1]] = buffer
    return wider


def _assemble(prompt, generated, new_counts, pad) -> np.ndarray:
    """RFC output: [real prompt | generated (with its EOS) | pad] per row, common width."""
    lengths = prompt.lengths + new_counts
    out = np.full((prompt.batch_size, int(lengths.max())), pad, dtype=np.int64)
    for row in range(prompt.batch_size):
        real = prompt.real_tokens(row)
        out[row, : real.size] = real
        out[row, real.size : real.size + new_counts[row]] = generated[row, : new_counts[row]]
    return out
