"""What the engine refuses before any work: a model it cannot batch, a bad setting, a request that
can never run (``ValueError`` / ``TypeError`` naming the field and the value)."""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

from ..config import model_defaults
from ..drivers import ForwardSignature, is_hf_model
from ..inputs import ModelLimits

_NEEDED = ("past_key_values", "attention_mask", "position_ids")


def check_engine_model(model) -> None:
    """TypeError unless the engine can batch ``model``: a native (cache-object) model, or an RFC
    model whose forward takes past_key_values, attention_mask and position_ids."""
    if model is None or not callable(model):
        raise TypeError(f"model must be a callable model (torch.nn.Module / mindspore.nn.Cell), got {model!r}")
    if is_hf_model(model):
        raise TypeError(
            f"the engine does not batch unmodified HF transformers models ({type(model).__name__}); load the "
            "checkpoint with hyper_gen.load_model(path) (native Qwen3.5), or use hyper_gen.generate for HF models"
        )
    if getattr(getattr(model, "cp_plan", None), "cp", 1) > 1:
        raise TypeError(
            "the engine does not batch context-parallel models yet (each rank holds a slice of every row's "
            "cache, which the paged cache's block tables do not describe): use hyper_gen.generate, or cp=1"
        )
    signature = ForwardSignature(model)
    missing = [name for name in _NEEDED if not signature.accepts(name)]
    if missing:
        raise TypeError(
            f"the engine needs a model whose forward takes {', '.join(_NEEDED)} (a cache-object model from "
            f"load_model, or the RFC contract); {type(model).__name__}'s forward takes no {', '.join(missing)}"
        )


def check_prompt_ids(prompt_token_ids, vocab) -> np.ndarray:
    """A request's prompt as a flat int array of ids inside the vocabulary (``vocab``; None: unknown)."""
    ids = np.asarray(prompt_token_ids)
    if ids.dtype == bool or ids.dtype == object or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise TypeError(f"prompt_token_ids must be a list of ints (token ids), got dtype {ids.dtype}")
    if ids.ndim != 1:
        raise ValueError(f"prompt_token_ids must be one flat list of ids, got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError("prompt_token_ids must not be empty")
    outside = np.flatnonzero((ids < 0) | (ids >= vocab if vocab else ids < 0))
    if outside.size:
        i = int(outside[0])
        limit = f"0..{vocab - 1} (the model's vocabulary of {vocab})" if vocab else "non-negative"
        raise ValueError(f"prompt_token_ids[{i}] = {int(ids[i])} is not a token id: ids are {limit}")
    return ids


def model_limits(model, max_model_len: Optional[int]) -> tuple:
    """(vocab_size, max_model_len, eos_token_ids) of an engine on ``model``: ``max_model_len`` (None:
    the model's context) must fit its ``max_position_embeddings``."""
    limits = ModelLimits.of(model)
    if max_model_len is not None and limits.context is not None and max_model_len > limits.context:
        raise ValueError(
            f"max_model_len={max_model_len} is more than the model's context of {limits.context} "
            "positions (max_position_embeddings)"
        )
    eos = model_defaults(model).get("eos_token_id")
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    return limits.vocab_size, max_model_len if max_model_len is not None else limits.context, eos_ids


def check_request(engine, prompt_len: int, params) -> None:
    """Whether ``engine`` can ever run a request of ``prompt_len`` tokens with ``params``: its context,
    its cache pool (alone), its batch, its tokenizer, the model's routing and vocabulary."""
    positions = prompt_len + params.max_tokens
    if engine.max_model_len is not None and positions > engine.max_model_len:
        raise ValueError(
            f"the prompt's {prompt_len} tokens + max_tokens={params.max_tokens} = {positions} positions, more "
            f"than max_model_len={engine.max_model_len}: shorten the prompt or lower max_tokens"
        )
    kv = engine._scheduler.kv
    if not kv.can_ever_fit(positions):
        raise ValueError(
            f"the prompt's {prompt_len} tokens + max_tokens={params.max_tokens} need {kv.blocks_needed(positions)} "
            f"KV cache blocks of {kv.block_size} positions, more than the engine's whole pool of {kv.num_blocks} "
            f"(cache_memory_bytes={engine.cache_memory_bytes}): raise cache_memory_bytes, or shorten the "
            "prompt or max_tokens"
        )
    if params.return_routed_experts:
        engine._runner.check_routes()  # ValueError: the model has no MoE layers
    if params.n > engine.max_batch_size:
        raise ValueError(f"n={params.n} is more than the engine's max_batch_size={engine.max_batch_size}")
    if params.stop and engine.tokenizer is None:
        raise ValueError(f"stop={params.stop!r} needs text: give the Engine a tokenizer")
    if params.structured_outputs is not None:
        backend = engine.grammar_backend()
        if backend is None:
            raise ValueError("structured_outputs needs the engine's tokenizer: give the Engine a tokenizer")
        backend.compile(params.structured_outputs)  # ValueError: the grammar library rejects it
    vocab = engine.vocab_size
    if vocab and params.stop_token_ids and max(params.stop_token_ids) >= vocab:
        raise ValueError(f"stop_token_ids {params.stop_token_ids} holds an id outside the vocabulary of {vocab}")


def positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


__all__ = ["check_engine_model", "check_prompt_ids", "check_request", "model_limits", "positive_int"]
