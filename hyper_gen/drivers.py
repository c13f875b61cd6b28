"""How each kind of model is stepped: one prefill, then one token per row per decode step.

- ``ReturnedCacheDriver``: the RFC contract; the model returns its past as (K, V) per layer.
- ``CacheObjectDriver``: the model writes into a ``StaticCache`` / ``DynamicCache`` in place.
- ``HFDriver``: an unmodified HF transformers causal LM, driven with the inputs HF's own
  ``generate`` gives it (2-D mask, cumsum positions, ``logits_to_keep=1``), so logits are
  bit-identical to HF's.

Every driver keeps ``use_cache=False`` honest: it recomputes the whole sequence each step.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from .cache import KVCache, make_cache
from .masks import decode_mask, full_sequence_mask, prefill_mask


def _logits(output) -> Any:
    if isinstance(output, dict):
        if "logits" not in output:
            raise ValueError(f"model output must contain 'logits', got keys {sorted(output)}")
        return output["logits"]
    if hasattr(output, "logits"):
        return output.logits
    raise TypeError(f"model must return a mapping with 'logits' (RFC contract), got {type(output).__name__}")


def _past(output) -> Any:
    if isinstance(output, dict):
        return output.get("past_key_values")
    return getattr(output, "past_key_values", None)


def is_hf_model(model) -> bool:
    """An HF ``PreTrainedModel`` with a ``GenerationMixin``, found without importing transformers."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(model).__mro__
    )


class _Driver:
    def __init__(self, model, ops, prompt, config, dtype: str):
        self.model = model
        self.ops = ops
        self.prompt = prompt
        self.config = config
        self.dtype = dtype
        self.total_length = prompt.width + config.max_new_tokens
        # host copy of every token so far, padding included: (B, width + steps)
        self.host_ids = prompt.ids
        self.host_mask = prompt.mask
        self.next_position = prompt.lengths.copy()

    def append(self, tokens: np.ndarray) -> None:
        """Bookkeeping after a step's tokens are chosen (host side)."""
        self.host_ids = np.concatenate([self.host_ids, tokens[:, None]], axis=1)
        self.host_mask = np.concatenate([self.host_mask, np.ones_like(tokens)[:, None]], axis=1)

    def _full_recompute(self):
        """use_cache=False: the model sees the whole sequence again."""
        ops = self.ops
        positions = np.where(self.host_mask == 1, np.cumsum(self.host_mask, axis=1) - 1, 0)
        return self._call_full(
            ops.asarray(self.host_ids, "int64"),
            ops.asarray(positions.astype(np.int64), "int64"),
            ops.asarray(full_sequence_mask(self.host_mask, self.dtype), self.dtype),
        )

    def _call_full(self, ids, positions, mask):
        raise NotImplementedError


class ReturnedCacheDriver(_Driver):
    """RFC contract 1: ``model(ids, position_ids=, attention_mask=, past_key_values=)``."""

    def __init__(self, *args):
        super().__init__(*args)
        self.cache = KVCache()
        self.use_cache = self.config.use_cache
        self._mask_buffer = None

    def _call_full(self, ids, positions, mask):
        return _logits(self.model(ids, position_ids=positions, attention_mask=mask, past_key_values=None))

    def prefill(self):
        ops, prompt = self.ops, self.prompt
        output = self.model(
            ops.asarray(prompt.ids, "int64"),
            position_ids=ops.asarray(prompt.position_ids(), "int64"),
            attention_mask=ops.asarray(prefill_mask(prompt.mask, prompt.width, self.dtype), self.dtype),
            past_key_values=None,
        )
        past = _past(output)
        if self.use_cache and past is None:
            self.use_cache = False  # the model keeps no cache: recompute, as HF does
        if self.use_cache:
            self.cache.update(past)
            if prompt.padded:
                self._mask_buffer = ops.asarray(decode_mask(prompt.mask, self.total_length, self.dtype), self.dtype)
                self._unmask = ops.asarray(np.zeros((prompt.batch_size, 1, 1, 1)), self.dtype)
        return _logits(output)

    def decode(self, tokens: np.ndarray, tokens_device):
        self.append(tokens)
        if not self.use_cache:
            return self._full_recompute()
        ops = self.ops
        length = self.host_ids.shape[1]
        mask = None
        if self._mask_buffer is not None:
            ops.write_slice(self._mask_buffer, 3, length - 1, self._unmask)
            mask = self._mask_buffer[:, :, :, :length]
        positions = ops.asarray(self.next_position[:, None], "int64")
        self.next_position = self.next_position + 1
        output = self.model(
            tokens_device, position_ids=positions, attention_mask=mask, past_key_values=self.cache.past_key_values
        )
        self.cache.update(_past(output))
        return _logits(output)


class CacheObjectDriver(_Driver):
    """Contract 2 (docs/model_contract.md): the model writes into a cache object in place."""

    def __init__(self, *args):
        super().__init__(*args)
        self._unmask = None

    def _new_cache(self, batch, length, implementation):
        return make_cache(implementation, self.ops, batch, length)

    def _call_full(self, ids, positions, mask):
        cache = self._new_cache(self.host_ids.shape[0], self.host_ids.shape[1], "dynamic")
        if self.prompt.padded:
            cache.prompt_mask = self.ops.asarray(self.host_mask, self.dtype)
        return _logits(
            self.model(ids, position_ids=positions, attention_mask=mask, past_key_values=cache, logits_to_keep=1)
        )

    def prefill(self):
        ops, prompt, cfg = self.ops, self.prompt, self.config
        if not cfg.use_cache:
            return self._full_recompute()
        self.cache = self._new_cache(prompt.batch_size, self.total_length, cfg.cache_implementation)
        if prompt.padded:
            self.cache.prompt_mask = ops.asarray(prompt.mask, self.dtype)
        key_length = self.total_length if self.cache.is_static else prompt.width
        output = self.model(
            ops.asarray(prompt.ids, "int64"),
            position_ids=ops.asarray(prompt.position_ids(), "int64"),
            attention_mask=ops.asarray(prefill_mask(prompt.mask, key_length, self.dtype), self.dtype),
            past_key_values=self.cache,
            logits_to_keep=1,
        )
        self.cache.advance(prompt.width)
        self.cache.prompt_mask = None
        self._mask = ops.asarray(decode_mask(prompt.mask, self.total_length, self.dtype), self.dtype)
        self._unmask = ops.asarray(np.zeros((prompt.batch_size, 1, 1, 1)), self.dtype)
        return _logits(output)

    def decode(self, tokens: np.ndarray, tokens_device):
        self.append(tokens)
        if not self.config.use_cache:
            return self._full_recompute()
        ops = self.ops
        position = self.cache.seq_length
        ops.write_slice(self._mask, 3, position, self._unmask)
        mask = self._mask if self.cache.is_static else self._mask[:, :, :, : position + 1]
        positions = ops.asarray(self.next_position[:, None], "int64")
        self.next_position = self.next_position + 1
        output = self.model(
            tokens_device, position_ids=positions, attention_mask=mask, past_key_values=self.cache, logits_to_keep=1
        )
        self.cache.advance(1)
        return _logits(output)


class HFDriver(_Driver):
    """Contract 3: an HF transformers model on HF's ``DynamicCache`` (HF generate's default);
    ``cache_implementation`` applies to cache-object models only."""

    def __init__(self, *args):
        super().__init__(*args)
        params = inspect.signature(self.model.forward).parameters
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._cache = None

    def _mask2d(self):
        # HF drops an all-ones mask before the first forward
        return self.ops.asarray(self.host_mask, "int64") if self.prompt.padded else None

    def _positions(self, last_only: bool):
        if last_only:  # the new token of each row: real prompt length + step
            positions, self.next_position = self.next_position[:, None], self.next_position + 1
            return self.ops.asarray(positions, "int64")
        mask = self.host_mask
        return self.ops.asarray(np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0).astype(np.int64), "int64")

    def _forward(self, ids, last_only: bool):
        return self.model(
            input_ids=ids,
            attention_mask=self._mask2d(),
            position_ids=self._positions(last_only),
            past_key_values=self._cache,
            use_cache=self.config.use_cache,
            return_dict=True,
            **self._keep,
        )

    def prefill(self):
        if self.config.use_cache:
            from transformers import DynamicCache  # an HF model is in hand, so transformers is installed

            self._cache = DynamicCache(config=self.model.config)
        return self._forward(self.ops.asarray(self.prompt.ids, "int64"), last_only=False).logits

    def decode(self, tokens: np.ndarray, tokens_device):
        self.append(tokens)
        if not self.config.use_cache:
            return self._forward(self.ops.asarray(self.host_ids, "int64"), last_only=False).logits
        return self._forward(tokens_device, last_only=True).logits


def make_driver(model, ops, prompt, config, dtype: str):
    """The driver for ``model``'s contract."""
    if is_hf_model(model):
        return HFDriver(model, ops, prompt, config, dtype)
    if getattr(model, "supports_cache_object", False):
        return CacheObjectDriver(model, ops, prompt, config, dtype)
    return ReturnedCacheDriver(model, ops, prompt, config, dtype)
