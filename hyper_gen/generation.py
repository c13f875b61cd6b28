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
from .inputs import prepare_prompts
from .parallel.model_group import check_consistent_inputs, gather_vocab_logits
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
    """
    if model is None or not callable(model):
        raise TypeError(f"model must be a callable model (torch.nn.Module / mindspore.nn.Cell), got {model!r}")
    config = resolve_config(generation_config, config_overrides, model)
    ops = backend_for(model, input_ids)
    prompt = prepare_prompts(input_ids, attention_mask)
    check_consistent_inputs(ops, model, prompt, config)
    dtype = ops.param_dtype(model)
    with ops.no_grad():
        return _decode_loop(model, ops, prompt, config, dtype, streamer, on_tokens)


def _decode_loop(model, ops, prompt, config, dtype, streamer, on_tokens):
    batch = prompt.batch_size
    driver = make_driver(model, ops, prompt, config, dtype)
    eos = np.asarray(config.eos_token_ids, dtype=np.int64)
    pad = config.pad_token_id
    needs_ids = bool(config.logits_processor or config.stopping_criteria)
    ids_view = ops.asarray(prompt.ids, "int64") if needs_ids else None
    unfinished = np.ones(batch, dtype=bool)
    generated = np.empty((batch, config.max_new_tokens), dtype=np.int64)
    new_counts = np.zeros(batch, dtype=np.int64)
    if streamer is not None:
        streamer.put(prompt.ids.copy())

    logits = driver.prefill()
    selector = None
    for step in range(config.max_new_tokens):
        scores = ops.cast(gather_vocab_logits(ops, model, logits[:, -1]), "float32")
        if selector is None:
            selector = TokenSelector(ops, config, prompt, int(scores.shape[-1]))
        tokens = selector.select(scores, step, ids_view)
        tokens = np.where(unfinished, tokens, pad)
        generated[:, step] = tokens
        new_counts += unfinished
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
        if not unfinished.any() or step + 1 == config.max_new_tokens:
            break
        logits = driver.decode(tokens, tokens_device)
    if streamer is not None:
        streamer.end()
    return ops.asarray(_assemble(prompt, generated, new_counts, pad), "int64")


def _assemble(prompt, generated, new_counts, pad) -> np.ndarray:
    """RFC output: [real prompt | generated (with its EOS) | pad] per row, common width."""
    lengths = prompt.lengths + new_counts
    out = np.full((prompt.batch_size, int(lengths.max())), pad, dtype=np.int64)
    for row in range(prompt.batch_size):
        real = prompt.real_tokens(row)
        out[row, : real.size] = real
        out[row, real.size : real.size + new_counts[row]] = generated[row, : new_counts[row]]
    return out
