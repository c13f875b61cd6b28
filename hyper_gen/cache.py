"""KV caches.

``KVCache`` is the RFC's holder for models that *return* their past (contract 1): a list of
(K, V) per layer, (B, H, T, D).

``StaticCache`` / ``DynamicCache`` are the cache objects of contract 2: the model *receives* one
and writes into it (``update(key, value, layer_idx)``), so a decode step never copies history
(static) or only appends (dynamic). They also hold the per-layer state of linear-attention layers
(Gated DeltaNet conv and recurrent state), which a list of (K, V) cannot.
Buffers are allocated lazily from the first write, so a tensor-parallel rank gets its local head
count for free.

A static cache is preallocated for the prompt + ``max_new_tokens`` positions (capped at the
model's context when it declares one), so its length is bounded by ``MAX_STATIC_POSITIONS``: a
longer one raises ``ValueError`` naming max_new_tokens before any forward, as does an
allocation that fails, instead of a framework out-of-memory error or a minutes-long allocation.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

Tensor = Any

# the longest static cache (positions per row) generate() preallocates; past it, use "dynamic"
MAX_STATIC_POSITIONS = 1 << 20


def _too_long(max_length: int, detail: str) -> ValueError:
    return ValueError(
        f"max_new_tokens is too large for cache_implementation='static', which preallocates prompt + "
        f"max_new_tokens = {max_length} positions per row{detail}: lower max_new_tokens, or pass "
        "cache_implementation='dynamic' (it grows as tokens are generated)"
    )


class KVCache:
    """RFC cache API: ``update`` / ``merge`` / ``detach`` / ``clear`` / ``get_seq_length``."""

    def __init__(self, past_key_values: Optional[List[Tuple[Tensor, Tensor]]] = None):
        self.past_key_values = None
        if past_key_values is not None:
            self.update(past_key_values)

    def update(self, past_key_values) -> None:
        """Replace the cache with what the model returned (every position so far)."""
        if past_key_values is None:
            self.past_key_values = None
            return
        layers = [tuple(layer) for layer in past_key_values]
        for i, layer in enumerate(layers):
            if len(layer) != 2:
                raise ValueError(f"past_key_values[{i}] must be a (key, value) pair, got {len(layer)} items")
        self.past_key_values = layers

    def merge(self, new_key_values, concat) -> None:
        """Append new positions to every layer along the sequence axis (axis 2)."""
        if self.past_key_values is None:
            self.update(new_key_values)
            return
        if len(new_key_values) != len(self.past_key_values):
            raise ValueError(f"merge got {len(new_key_values)} layers but the cache holds {len(self.past_key_values)}")
        self.past_key_values = [
            (concat([k, nk], 2), concat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.past_key_values, new_key_values)
        ]

    def detach(self) -> None:
        """Cut every tensor from any autograd graph (generation runs under no-grad anyway)."""
        if self.past_key_values is None:
            return
        self.past_key_values = [
            tuple(t.detach() if hasattr(t, "detach") else t for t in layer) for layer in self.past_key_values
        ]

    def clear(self) -> None:
        self.past_key_values = None

    def get_seq_length(self) -> int:
        if not self.past_key_values:
            return 0
        return int(self.past_key_values[0][0].shape[2])

    def __len__(self) -> int:
        return 0 if self.past_key_values is None else len(self.past_key_values)

    def is_empty(self) -> bool:
        return self.past_key_values is None


class _ModelCache:
    """What both cache objects share: write position, linear-attention state, prompt mask."""

    def __init__(self, ops, batch_size: int, max_length: int):
        self.ops = ops
        self.batch_size = batch_size
        self.max_length = max_length
        self.seq_length = 0  # positions already written; the core advances it after each forward
        self.conv_states: Dict[int, Tensor] = {}
        self.recurrent_states: Dict[int, Tensor] = {}
        # (B, S) 1/0 mask of the prompt in the model dtype, None when no row is padded.
        # Linear-attention layers zero padded positions with it before building their state.
        self.prompt_mask: Optional[Tensor] = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_length

    def advance(self, n: int) -> None:
        self.seq_length += n
        if self.seq_length > self.max_length:
            raise ValueError(f"cache overflow: {self.seq_length} positions > max_length {self.max_length}")

    def attend(self, query, key, value, mask, layer_idx: int, dense, partial, scale=None):
        """Attention of a step's ``query`` over this cache after writing the step's ``key`` /
        ``value``: ``dense(query, keys, values, mask)`` over what ``update`` returns. A cache that
        reads its K/V in pieces (the engine's paged pool) merges ``partial``'s (output, log-sum-exp)
        per piece instead, or (given the port's softmax ``scale``) attends in place with the
        backend's paged kernel; a port calls this rather than ``update`` so any of them can serve it."""
        keys, values = self.update(key, value, layer_idx)
        return dense(query, keys, values, mask)

    def has_linear_state(self, layer_idx: int) -> bool:
        return layer_idx in self.recurrent_states


class StaticCache(_ModelCache):
    """Preallocated (B, H, max_length, D) per layer, written in place; ``update`` returns the
    whole buffer and the core's attention mask hides the positions not yet written."""

    is_static = True

    def __init__(self, ops, batch_size: int, max_length: int):
        if max_length > MAX_STATIC_POSITIONS:
            raise _too_long(max_length, f", over hyper_gen.cache.MAX_STATIC_POSITIONS = {MAX_STATIC_POSITIONS}")
        super().__init__(ops, batch_size, max_length)
        self.keys: Dict[int, Tensor] = {}
        self.values: Dict[int, Tensor] = {}

    def update(self, key: Tensor, value: Tensor, layer_idx: int) -> Tuple[Tensor, Tensor]:
        if layer_idx not in self.keys:
            b, h, _, d = key.shape
            try:
                self.keys[layer_idx] = self.ops.zeros((b, h, self.max_length, d), self.ops.dtype_name(key))
                self.values[layer_idx] = self.ops.zeros(
                    (b, value.shape[1], self.max_length, value.shape[3]), self.ops.dtype_name(value)
                )
            except (MemoryError, RuntimeError) as error:  # torch / MindSpore out of memory
                self.keys.pop(layer_idx, None)
                detail = f", and allocating layer {layer_idx}'s buffers failed ({error})"
                raise _too_long(self.max_length, detail) from error
        end = self.seq_length + key.shape[2]
        if end > self.max_length:
            raise ValueError(f"cache overflow: writing up to position {end} > max_length {self.max_length}")
        self.ops.write_slice(self.keys[layer_idx], 2, self.seq_length, key)
        self.ops.write_slice(self.values[layer_idx], 2, self.seq_length, value)
        return self.keys[layer_idx], self.values[layer_idx]

    def attended_length(self) -> int:
        return self.max_length


class DynamicCache(_ModelCache):
    """Grows by concatenation; ``update`` returns exactly the positions written so far."""

    is_static = False

    def __init__(self, ops, batch_size: int, max_length: int):
        super().__init__(ops, batch_size, max_length)
        self.keys: Dict[int, Tensor] = {}
        self.values: Dict[int, Tensor] = {}

    def update(self, key: Tensor, value: Tensor, layer_idx: int) -> Tuple[Tensor, Tensor]:
        if layer_idx in self.keys:
            self.keys[layer_idx] = self.ops.concat([self.keys[layer_idx], key], 2)
            self.values[layer_idx] = self.ops.concat([self.values[layer_idx], value], 2)
        else:
            self.keys[layer_idx], self.values[layer_idx] = key, value
        return self.keys[layer_idx], self.values[layer_idx]

    def attended_length(self) -> int:
        return self.seq_length


def static_length(positions: int, multiple: int) -> int:
    """A static cache's buffer length for ``positions``: rounded up to ``multiple`` (a model's
    ``static_cache_multiple``; 1: exactly ``positions``). A model whose decode step is compiled
    for its buffers' shape (MindSpore graphs) then reuses one graph for every batch whose prompt +
    max_new_tokens falls in the same bucket, instead of compiling one per length; the extra
    positions are never written and the attention mask hides them. Never past
    MAX_STATIC_POSITIONS by rounding."""
    if multiple <= 1:
        return positions
    rounded = -(-positions // multiple) * multiple
    return rounded if rounded <= MAX_STATIC_POSITIONS else positions


def make_cache(implementation: str, ops, batch_size: int, max_length: int, static_multiple: int = 1):
    """The cache object ``cache_implementation`` names; a static one ``static_length`` long."""
    if implementation == "static":
        return StaticCache(ops, batch_size, static_length(max_length, static_multiple))
    if implementation == "dynamic":
        return DynamicCache(ops, batch_size, max_length)
    raise ValueError(f"cache_implementation must be 'static' or 'dynamic', got {implementation!r}")
