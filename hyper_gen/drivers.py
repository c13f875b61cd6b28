"""How each kind of model is stepped: one prefill, then one token per row per decode step.

- ``ReturnedCacheDriver``: the RFC contract; the model returns its past as (K, V) per layer.
- ``CacheObjectDriver``: the model writes into a ``StaticCache`` / ``DynamicCache`` in place.
- ``HFDriver``: an unmodified HF transformers causal LM, driven with the inputs HF's own
  ``generate`` gives it (2-D mask, cumsum positions, ``logits_to_keep=1``), so logits are
  bit-identical to HF's.

Every driver calls the model only with the keyword arguments its forward accepts (the
signature is read once per driver, see ``ForwardSignature``), and keeps ``use_cache=False``
honest: it recomputes the whole sequence each step. A model that takes no cache argument is
recomputed the same way. Errors raised inside the model propagate unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import numpy as np

from .cache import KVCache, make_cache
from .masks import decode_mask, full_sequence_mask, prefill_mask
from .positions import cumsum_positions

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
DECODE_MASK_STEPS = 256  # a dynamic cache's first decode mask: this many steps past the prompt, then doubled


class ForwardSignature:
    """The keyword arguments a model's forward accepts, read once from its signature.

    The forward is ``model.construct`` for a MindSpore Cell, ``model.forward`` for a torch
    Module (found by duck typing, no framework import), and the callable itself otherwise.
    ``**kwargs`` in the signature (or no readable signature) means every keyword is accepted.
    """

    def __init__(self, model):
        self.names: frozenset = frozenset()
        self.takes_any = True
        try:
            params = inspect.signature(_forward_of(model)).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: pass everything, as before
            return
        self.names = frozenset(p.name for p in params if p.kind in _NAMED)
        self.takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)

    def declares(self, name: str) -> bool:
        return name in self.names

    def accepts(self, name: str) -> bool:
        return self.takes_any or name in self.names

    def keep(self, kwargs: dict) -> dict:
        """``kwargs`` without the keywords the forward does not accept."""
        if self.takes_any:
            return kwargs
        return {name: value for name, value in kwargs.items() if name in self.names}


def _forward_of(model):
    for name in ("construct", "forward"):  # MindSpore Cell, torch Module
        method = getattr(model, name, None)
        if callable(method):
            return method
    return model


def logits_of(output, ops) -> Any:
    """The logits of a forward's output (a mapping or an object with ``.logits``), made whole first
    when they come back as a distributed tensor: HyperParallel's DTensor refuses even the slice that
    keeps the last position (it has no layout rule for ``__getitem__``)."""
    if isinstance(output, dict):
        if "logits" not in output:
            raise ValueError(f"model output must contain 'logits', got keys {sorted(output)}")
        logits = output["logits"]
    elif hasattr(output, "logits"):
        logits = output.logits
    else:
        raise TypeError(f"model must return a mapping with 'logits' (RFC contract), got {type(output).__name__}")
    return ops.full_tensor(logits) if ops.is_distributed(logits) else logits


def past_of(output) -> Any:
    """The past a forward returned (RFC contract), or None."""
    if isinstance(output, dict):
        return output.get("past_key_values")
    return getattr(output, "past_key_values", None)


def is_hf_model(model) -> bool:
    """An HF ``PreTrainedModel`` with a ``GenerationMixin``, found without importing transformers."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(model).__mro__
    )


class _Driver:
    """Shared bookkeeping: host copy of the tokens, decode positions, the preallocated decode
    mask (one column unmasked per step), full recompute, and the signature filter.

    Subclasses set ``self.use_cache`` and implement ``prefill``, ``_call_full`` (a forward
    over the whole sequence) and ``_call_decode`` (a forward over the new tokens).
    """

    def __init__(self, model, ops, prompt, config, dtype: str):
        self.model = model
        self.ops = ops
        self.prompt = prompt
        self.config = config
        self.dtype = dtype
        self.signature = ForwardSignature(model)
        if prompt.padded and not self.signature.accepts("attention_mask"):
            raise ValueError(
                f"{type(model).__name__}'s forward takes no attention_mask, so it cannot be told which "
                "tokens are left padding: pass prompts of equal length without padding (an all-ones "
                "attention_mask is fine), or give the forward an attention_mask argument"
            )
        self.total_length = prompt.width + config.max_new_tokens
        # host copy of every token so far, padding included: (B, width + steps)
        self.host_ids = prompt.ids
        self.host_mask = prompt.mask
        self.next_position = prompt.lengths.copy()
        self._decode_mask: Optional[Any] = None  # (B, 1, 1, total_length) additive, device
        self._whole_decode_mask = False  # static cache: the model attends over every column
        self._unmask = None

    def _expand(self, logits):
        """After the prefill: each prompt row repeated ``num_return_sequences`` times (HF's
        ``repeat_interleave`` order), its cache copied rather than recomputed, and the logits with it."""
        repeats = self.config.num_return_sequences
        if repeats == 1:
            return logits
        rows = np.repeat(np.arange(self.prompt.batch_size), repeats)
        self.prompt = self.prompt.take(rows)
        self.host_ids, self.host_mask = self.prompt.ids, self.prompt.mask
        self.next_position = self.prompt.lengths.copy()
        self._repeat_cache(rows)
        return self.ops.take(logits, rows, 0)

    def _repeat_cache(self, rows: np.ndarray) -> None:
        """Copy the cache's rows ``rows`` (nothing to do without a cache)."""

    def dummy_step(self) -> None:
        """A forward whose result is thrown away, for a step-synced rank whose rows are all finished:
        one token, no cache, so it costs little and leaves the cache untouched, and its collectives
        (FSDP's parameter all-gathers, a TP layer's reductions) pair with the other ranks' forwards."""
        self._call(
            self.ops.asarray(self.prompt.ids[:1, -1:], "int64"),
            position_ids=self._device(np.zeros((1, 1), dtype=np.int64), "int64", "position_ids"),
            attention_mask=None,
            past_key_values=None,
            **self._dummy_extra,
        )

    _dummy_extra: dict = {}  # what a contract adds to the dummy forward (cache-object models: logits_to_keep)

    def _call(self, ids, **kwargs):
        """The model on ``ids`` with the keywords its forward accepts (errors propagate)."""
        return self.model(ids, **self.signature.keep(kwargs))

    def _device(self, array: np.ndarray, dtype: str, name: str):
        """``array`` on the device, or None when the forward does not take ``name`` (no op)."""
        return self.ops.asarray(array, dtype) if self.signature.accepts(name) else None

    def append(self, tokens: np.ndarray) -> None:
        """Bookkeeping after a step's tokens are chosen (host side)."""
        self.host_ids = np.concatenate([self.host_ids, tokens[:, None]], axis=1)
        self.host_mask = np.concatenate([self.host_mask, np.ones_like(tokens)[:, None]], axis=1)

    def _prefill_inputs(self, key_length: int):
        """The prompt's ids, positions and (B, 1, S, key_length) mask on the device."""
        prompt = self.prompt
        return (
            self.ops.asarray(prompt.ids, "int64"),
            self._device(prompt.position_ids(), "int64", "position_ids"),
            self._device(prefill_mask(prompt.mask, key_length, self.dtype), self.dtype, "attention_mask"),
        )

    def _allocate_decode_mask(self, whole: bool, columns: int = 0) -> None:
        """Preallocate the decode mask: prompt padding masked, later columns masked until written.

        A static cache attends over all its ``columns`` (its buffer length), so its mask is whole;
        otherwise it starts ``DECODE_MASK_STEPS`` wide and doubles when the sequence outgrows it (nothing sized
        to max_new_tokens)."""
        if not self.signature.accepts("attention_mask"):
            return
        prompt = self.prompt
        if not whole:
            columns = min(self.total_length, prompt.width + DECODE_MASK_STEPS)
        self._decode_mask = self.ops.asarray(decode_mask(prompt.mask, columns, self.dtype), self.dtype)
        self._unmask = self.ops.asarray(np.zeros((prompt.batch_size, 1, 1, 1)), self.dtype)
        self._whole_decode_mask = whole

    def decode(self, tokens: np.ndarray, tokens_device):
        self.append(tokens)
        if not self.use_cache:
            return self._full_recompute()
        length = self.host_ids.shape[1]
        mask = self._decode_mask
        if mask is not None:
            if length > mask.shape[3]:  # grown past it (never whole): twice the columns, the new ones masked
                extra = min(self.total_length, 2 * mask.shape[3]) - mask.shape[3]
                masked = decode_mask(np.zeros((mask.shape[0], 0), dtype=np.int64), extra, self.dtype)
                mask = self._decode_mask = self.ops.concat([mask, self.ops.asarray(masked, self.dtype)], 3)
            self.ops.write_slice(mask, 3, length - 1, self._unmask)  # the new token's column
            if not self._whole_decode_mask:
                mask = mask[:, :, :, :length]
        return self._call_decode(tokens_device, self._decode_positions(), mask)

    def _decode_positions(self):
        """The new token of each row: real prompt length + step."""
        positions = self._device(self.next_position[:, None], "int64", "position_ids")
        self.next_position = self.next_position + 1
        return positions

    def _full_recompute(self):
        """use_cache=False (or no cache argument): the model sees the whole sequence again."""
        return self._call_full(
            self.ops.asarray(self.host_ids, "int64"),
            self._device(cumsum_positions(self.host_mask), "int64", "position_ids"),
            self._device(full_sequence_mask(self.host_mask, self.dtype), self.dtype, "attention_mask"),
        )

    def all_logits(self):
        """Every position's logits (B, S, V) of the prompt batch in one forward without a cache (what
        ``hyper_gen.score`` reads): the forward generate's ``use_cache=False`` recompute makes, the same
        ids, positions and mask, with no logit dropped."""
        return self._call_full(
            self.ops.asarray(self.host_ids, "int64"),
            self._device(cumsum_positions(self.host_mask), "int64", "position_ids"),
            self._device(full_sequence_mask(self.host_mask, self.dtype), self.dtype, "attention_mask"),
            keep=0,
        )

    def prefill(self):
        raise NotImplementedError

    def _call_full(self, ids, positions, mask, keep: int = 1):
        """A forward over the whole sequence; ``keep``: the logits kept (1 the last position's, 0 all)
        where the contract lets the model drop the others."""
        raise NotImplementedError

    def _call_decode(self, tokens_device, positions, mask):
        raise NotImplementedError


class ReturnedCacheDriver(_Driver):
    """RFC contract 1: ``model(ids, position_ids=, attention_mask=, past_key_values=)``."""

    def __init__(self, *args):
        super().__init__(*args)
        self.cache = KVCache()
        self.use_cache = self.config.use_cache and self.signature.accepts("past_key_values")

    def _call_full(self, ids, positions, mask, keep: int = 1):
        output = self._call(ids, position_ids=positions, attention_mask=mask, past_key_values=None)
        return logits_of(output, self.ops)

    def prefill(self):
        prompt = self.prompt
        ids, positions, mask = self._prefill_inputs(prompt.width)
        output = self._call(ids, position_ids=positions, attention_mask=mask, past_key_values=None)
        if self.use_cache:
            past = past_of(output)
            if past is None:
                self.use_cache = False  # the model keeps no cache: recompute, as HF does
            else:
                self.cache.update(past)
        logits = self._expand(logits_of(output, self.ops))
        if self.use_cache and prompt.padded:
            self._allocate_decode_mask(whole=False)
        return logits

    def _repeat_cache(self, rows):
        if self.cache.past_key_values is not None:
            take = self.ops.take
            self.cache.update([(take(k, rows, 0), take(v, rows, 0)) for k, v in self.cache.past_key_values])

    def _call_decode(self, tokens_device, positions, mask):
        output = self._call(
            tokens_device, position_ids=positions, attention_mask=mask, past_key_values=self.cache.past_key_values
        )
        self.cache.update(past_of(output))
        return logits_of(output, self.ops)


class CacheObjectDriver(_Driver):
    """Contract 2 (docs/model_contract.md): the model writes into a cache object in place."""

    _dummy_extra = {"logits_to_keep": 1}

    def __init__(self, *args):
        super().__init__(*args)
        self.use_cache = self.config.use_cache and self.signature.accepts("past_key_values")
        # positions a static cache's length is rounded up to (hyper_gen.cache.static_length)
        self.static_multiple = int(getattr(self.model, "static_cache_multiple", 1))

    def _call_full(self, ids, positions, mask, keep: int = 1):
        cache = make_cache("dynamic", self.ops, self.host_ids.shape[0], self.host_ids.shape[1])
        if self.prompt.padded:
            cache.prompt_mask = self.ops.asarray(self.host_mask, self.dtype)
        kwargs = dict(position_ids=positions, attention_mask=mask, past_key_values=cache, logits_to_keep=keep)
        output = self._call(ids, **kwargs)
        return logits_of(output, self.ops)

    def prefill(self):
        ops, prompt, cfg = self.ops, self.prompt, self.config
        if not self.use_cache:
            return self._expand(self._full_recompute())
        cache = make_cache(cfg.cache_implementation, ops, prompt.batch_size, self.total_length, self.static_multiple)
        self.cache = cache
        if prompt.padded:
            cache.prompt_mask = ops.asarray(prompt.mask, self.dtype)
        key_length = cache.max_length if cache.is_static else prompt.width
        ids, positions, mask = self._prefill_inputs(key_length)
        output = self._call(
            ids, position_ids=positions, attention_mask=mask, past_key_values=self.cache, logits_to_keep=1
        )
        self.cache.advance(prompt.width)
        self.cache.prompt_mask = None
        logits = self._expand(logits_of(output, self.ops))
        self._allocate_decode_mask(whole=cache.is_static, columns=cache.max_length)
        return logits

    def _repeat_cache(self, rows):
        cache = getattr(self, "cache", None)
        if cache is None:
            return
        for store in (cache.keys, cache.values, cache.conv_states, cache.recurrent_states):
            for layer in list(store):
                store[layer] = self.ops.take(store[layer], rows, 0)
        cache.batch_size = len(rows)

    def _call_decode(self, tokens_device, positions, mask):
        output = self._call(
            tokens_device, position_ids=positions, attention_mask=mask, past_key_values=self.cache, logits_to_keep=1
        )
        self.cache.advance(1)
        return logits_of(output, self.ops)


class HFDriver(_Driver):
    """Contract 3: an HF transformers model on HF's ``DynamicCache`` (HF generate's default);
    ``cache_implementation`` applies to cache-object models only.

    The cache goes under the name the forward declares (``cache`` in newer transformers,
    ``past_key_values`` before); ``logits_to_keep`` only when declared; ``use_cache`` and
    ``return_dict`` when declared or taken by ``**kwargs``. A forward with no cache argument
    is recomputed each step."""

    def __init__(self, *args):
        super().__init__(*args)
        sig = self.signature
        if sig.declares("cache"):
            self.cache_argument = "cache"
        elif sig.accepts("past_key_values"):
            self.cache_argument = "past_key_values"
        else:
            self.cache_argument = None
        self.use_cache = self.config.use_cache and self.cache_argument is not None
        fixed = {"return_dict": True} if sig.accepts("return_dict") else {}
        if sig.accepts("use_cache"):
            fixed["use_cache"] = self.use_cache
        if sig.declares("logits_to_keep"):
            fixed["logits_to_keep"] = 1
        self._fixed = fixed
        self._cache = None

    def _forward(self, ids, positions, keep: int = 1):
        kwargs = dict(self._fixed)
        if "logits_to_keep" in kwargs:
            kwargs["logits_to_keep"] = keep
        if self.cache_argument is not None:  # None while use_cache=False, as HF passes it
            kwargs[self.cache_argument] = self._cache
        if self.signature.accepts("attention_mask"):  # HF drops an all-ones mask before the first forward
            kwargs["attention_mask"] = self.ops.asarray(self.host_mask, "int64") if self.prompt.padded else None
        if positions is not None:
            kwargs["position_ids"] = positions
        return logits_of(self.model(input_ids=ids, **kwargs), self.ops)

    def _full_recompute(self):
        positions = self._device(cumsum_positions(self.host_mask), "int64", "position_ids")
        return self._forward(self.ops.asarray(self.host_ids, "int64"), positions)

    def all_logits(self):
        """Every position's logits, HF's inputs (2-D mask, cumsum positions), without a cache."""
        positions = self._device(cumsum_positions(self.host_mask), "int64", "position_ids")
        return self._forward(self.ops.asarray(self.host_ids, "int64"), positions, keep=0)

    def prefill(self):
        if self.use_cache:
            from transformers import DynamicCache  # an HF model is in hand, so transformers is installed

            self._cache = DynamicCache(config=self.model.config)
        return self._expand(self._full_recompute())

    def _repeat_cache(self, rows):
        """Every tensor HF's cache layers hold (attention keys / values, linear-attention conv and
        recurrent states), row-indexed: HF's own ``batch_repeat_interleave`` skips linear-attention layers."""
        base = len(rows) // self.config.num_return_sequences

        def repeated(value):
            is_row_batched = self.ops.is_tensor(value) and value.ndim > 0 and value.shape[0] == base
            return self.ops.take(value, rows, 0) if is_row_batched else value

        for layer in getattr(self._cache, "layers", None) or ():
            for name, value in list(vars(layer).items()):
                if isinstance(value, dict):
                    for key, state in list(value.items()):
                        value[key] = repeated(state)
                else:
                    setattr(layer, name, repeated(value))

    def dummy_step(self) -> None:
        fixed = {k: v for k, v in self._fixed.items() if k != "logits_to_keep" or self.signature.declares(k)}
        if "use_cache" in fixed:
            fixed["use_cache"] = False
        self.model(input_ids=self.ops.asarray(self.prompt.ids[:1, -1:], "int64"), **fixed)

    def _call_decode(self, tokens_device, positions, mask):
        return self._forward(tokens_device, positions)


def make_driver(model, ops, prompt, config, dtype: str):
    """The driver for ``model``'s contract."""
    if is_hf_model(model):
        return HFDriver(model, ops, prompt, config, dtype)
    if getattr(model, "supports_cache_object", False):
        return CacheObjectDriver(model, ops, prompt, config, dtype)
    return ReturnedCacheDriver(model, ops, prompt, config, dtype)
