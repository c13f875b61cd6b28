"""``EngineConfig``: the engine's cache and scheduler settings in one value, with vLLM's names where vLLM
has one (``max_num_seqs``, ``max_model_len``, ``block_size``, ``enable_prefix_caching``,
``max_num_batched_tokens``, ``kv_cache_memory_bytes``) and hyper_gen's own for the rest
(``state_snapshot_blocks``, ``admit_batch``).

A bad value is refused when the config is made (``ValueError`` / ``TypeError`` naming the field and
the value); what needs the model (``max_model_len`` against its context) is checked by ``Engine``.
``Engine(model, tokenizer, config, **overrides)`` also takes every field as a keyword, and the
engine's older names: ``max_batch_size`` (``max_num_seqs``), ``cache_memory_bytes``
(``kv_cache_memory_bytes``) and the deprecated ``max_prefill_tokens`` (``max_num_batched_tokens``).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Optional

from ..kv_cache.manager import DEFAULT_STATE_SNAPSHOT_BLOCKS
from .checks import positive_int

# the engine's older keyword -> the EngineConfig field it sets
OLD_NAMES = {
    "max_batch_size": "max_num_seqs",
    "cache_memory_bytes": "kv_cache_memory_bytes",
    "max_prefill_tokens": "max_num_batched_tokens",
}


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (``Engine(model, tokenizer, config=EngineConfig(...))``).

    ``max_num_seqs``: rows (choices) decoded together. ``max_model_len``: positions a request may use
    (prompt + max_tokens); None: the model's ``max_position_embeddings``. ``block_size``: positions
    per KV cache block. ``enable_prefix_caching``: requests share the blocks of a common prompt
    prefix. ``max_num_batched_tokens``: the most tokens a step computes, decoding rows included
    (longer prompts are prefilled in chunks). ``kv_cache_memory_bytes``: the KV cache pool; None:
    what ``max_num_seqs`` rows of ``max_model_len`` positions could use, within a quarter of the
    host's available memory. ``state_snapshot_blocks``: blocks between a hybrid model's recurrent
    state snapshots (where a prefix hit may resume). ``admit_batch``: admit waiting requests only
    once this many slots are free (or the batch is empty); 1 gives the lowest latency.

    None stays None here (the engine resolves it: ``engine.max_model_len``, ``engine.stats()``).
    """

    max_num_seqs: int = 32
    max_model_len: Optional[int] = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: Optional[int] = None
    state_snapshot_blocks: int = DEFAULT_STATE_SNAPSHOT_BLOCKS
    admit_batch: int = 1

    def __post_init__(self):
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens", "state_snapshot_blocks", "admit_batch"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        for name in ("max_model_len", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, positive_int(name, getattr(self, name)))

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` (field names; checked like the constructor's)."""
        return dataclasses.replace(self, **changes)


def resolve_engine_config(config: Optional[EngineConfig], overrides: dict, stacklevel: int = 2) -> EngineConfig:
    """``config`` (None: the defaults) with ``Engine``'s keyword ``overrides``: EngineConfig's fields,
    or the engine's older names (a bad value is refused under the name it was given). Both an old
    name and its new one, or an unknown keyword, is a ``TypeError``. ``stacklevel``: the deprecation
    warning's, counted from here (2: this function's caller)."""
    if config is None:
        config = EngineConfig()
    elif not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {config!r}")
    fields = {field.name for field in dataclasses.fields(EngineConfig)}
    unknown = [name for name in overrides if name not in fields and name not in OLD_NAMES]
    if unknown:
        raise TypeError(f"Engine() got an unexpected keyword argument {', '.join(map(repr, unknown))}")
    changes = {name: value for name, value in overrides.items() if name in fields}
    for old, new in OLD_NAMES.items():
        if old not in overrides:
            continue
        value = overrides[old]
        if old == "max_prefill_tokens" and value is None:  # its old default: not given
            continue
        if new in overrides:
            raise TypeError(f"Engine() got both {old}= and {new}= ({old} is the older name of {new}): pass one")
        if old == "max_prefill_tokens":
            warnings.warn(
                "Engine(max_prefill_tokens=...) is now max_num_batched_tokens (prompts are prefilled in chunks)",
                DeprecationWarning,
                stacklevel=stacklevel,
            )
        if old == "max_batch_size" or (old == "cache_memory_bytes" and value is not None):
            value = positive_int(old, value)
        changes[new] = value
    return config.replace(**changes) if changes else config


__all__ = ["EngineConfig", "resolve_engine_config"]
