"""The running batch: one cache whose rows are requests that joined at different times.

Rows are right-aligned at the cache's write position: every row's newest token sits in the same
column, so a decode step is one (B, 1) forward whatever each row's length. A row's older columns
are its own history; columns before its first token (and, for a row that joined a wider batch,
the columns the batch had before it came) are padding, masked in the additive attention mask.
Each row carries its own position (its real length), so rotary positions are those it would have
alone. Gated DeltaNet layers keep their conv and recurrent state per row; only attention layers
have columns.

- ``prefill(prompts)``: the joiners alone, left-padded into one forward (``cache.prompt_mask``
  keeps padding out of the linear-attention state, as generate does), on a fresh cache.
- ``join(group, rows)``: splice the prefilled group's rows (repeated for n choices) into the
  batch, left-padding whichever side is narrower.
- ``drop(keep)``: keep only some rows, then trim the leading columns no row uses any more, so
  the width is the longest live row, never the history of the whole run.
- ``decode()``: one step for every row.

Two model contracts: cache-object models (the native ports) get a ``DynamicCache`` whose
tensors this module reorders; RFC models return their past, which is stored in the same
per-layer dicts. Row operations are ``ops.take`` / ``ops.concat`` / ``ops.zeros`` on the batch
axis (0) and basic slicing on the column axis (2).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import numpy as np

from ..cache import DynamicCache
from ..drivers import ForwardSignature, logits_of, past_of
from ..masks import decode_mask, prefill_mask
from ..outputs import RoutedExperts
from ..positions import cumsum_positions

_UNBOUNDED = 1 << 40  # the cache's own overflow check; the engine bounds every row by max_model_len


class PrefillGroup:
    """Joiners prefilled together: their cache (J rows, width S), column validity, lengths."""

    def __init__(self, state, valid: np.ndarray, lengths: np.ndarray, logits, routed=None):
        self.state = state  # _State of J rows
        self.valid = valid  # (J, S) bool
        self.lengths = lengths  # (J,) real prompt tokens
        self.logits = logits  # (J, V) device: the last prompt position's logits
        self.routed = routed  # (J, moe_layers, top_k) host: the last prompt position's routing, if asked


# the per-layer stores of a _State, and whether their tensors have columns (axis 2)
_STORES = (("keys", True), ("values", True), ("conv", False), ("recurrent", False))


class _State:
    """Per-layer tensors of a set of rows: attention K/V (B, H, T, D), linear-attention states (B, ...)."""

    def __init__(self):
        self.keys: Dict[int, Any] = {}
        self.values: Dict[int, Any] = {}
        self.conv: Dict[int, Any] = {}
        self.recurrent: Dict[int, Any] = {}
        self.width = 0

    def tensors(self):
        """(store name, layer, tensor, has columns) of every tensor."""
        for name, columns in _STORES:
            for layer, tensor in list(getattr(self, name).items()):
                yield name, layer, tensor, columns

    def set(self, name: str, layer: int, tensor) -> None:
        getattr(self, name)[layer] = tensor

    @classmethod
    def of_cache(cls, cache) -> "_State":
        state = cls()
        state.keys, state.values = dict(cache.keys), dict(cache.values)
        state.conv, state.recurrent = dict(cache.conv_states), dict(cache.recurrent_states)
        state.width = cache.seq_length
        return state

    @classmethod
    def of_past(cls, past, width: int) -> "_State":
        state = cls()
        for layer, pair in enumerate(past):
            state.keys[layer], state.values[layer] = pair[0], pair[1]
        state.width = width
        return state


class RaggedBatch:
    """The live rows (any objects; the engine's choices) and their cache, positions and masks."""

    def __init__(self, model, ops, dtype: str):
        self.model = model
        self.ops = ops
        self.dtype = dtype
        self.signature = ForwardSignature(model)
        self.cache_object = bool(getattr(model, "supports_cache_object", False))
        self.rows: List[Any] = []
        self.state: Optional[_State] = None
        self.valid = np.zeros((0, 0), dtype=bool)  # (B, W): which columns hold a row's own tokens
        self.positions = np.zeros(0, dtype=np.int64)  # (B,) the position of each row's next token
        self.pending = np.zeros(0, dtype=np.int64)  # (B,) the token each row feeds next
        # (rows, moe_layers, top_k) host: the routing of the forward whose logits chose the rows' latest
        # tokens (decode's rows, or join's), when asked (``routes=True``); else None
        self.routed: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return 0 if self.state is None else self.state.width

    # ---- forwards ----------------------------------------------------------------------------
    def _call(self, ids, **kwargs):
        return self.model(ids, **self.signature.keep(kwargs))

    def check_routes(self) -> RoutedExperts:
        """The recorder of the model's router choices (ValueError: the model reports no MoE routing)."""
        return RoutedExperts(self.ops, self.model)

    def _routed(self, forward, valid: np.ndarray, routes: bool):
        """``forward()``'s output, and each row's routing at its last position when ``routes``."""
        if not routes:
            return forward(), None
        recorder = self.check_routes()
        output, recorded = recorder.forward(forward)
        return output, recorder.positions(recorded, valid)[:, -1]

    def prefill(self, prompts: List[List[int]], routes: bool = False) -> PrefillGroup:
        """One forward over the joiners' prompts, left-padded to the longest; ``routes``: record the
        routing of their last prompt positions (``PrefillGroup.routed``)."""
        ops = self.ops
        width = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), width), dtype=np.int64)
        valid = np.zeros((len(prompts), width), dtype=bool)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = prompt
            valid[row, width - len(prompt) :] = True
        positions = cumsum_positions(valid.astype(np.int64))
        mask = ops.asarray(prefill_mask(valid.astype(np.int64), width, self.dtype), self.dtype)
        kwargs = dict(position_ids=ops.asarray(positions, "int64"), attention_mask=mask)
        if self.cache_object:
            cache = DynamicCache(ops, len(prompts), _UNBOUNDED)
            if not valid.all():
                cache.prompt_mask = ops.asarray(valid.astype(np.int64), self.dtype)
            kwargs.update(past_key_values=cache, logits_to_keep=1)
            call = functools.partial(self._call, ops.asarray(ids, "int64"), **kwargs)
            output, routed = self._routed(call, valid, routes)
            cache.advance(width)
            state = _State.of_cache(cache)
        else:
            call = functools.partial(self._call, ops.asarray(ids, "int64"), past_key_values=None, **kwargs)
            output, routed = self._routed(call, valid, routes)
            past = past_of(output)
            if past is None:
                raise TypeError(
                    f"{type(self.model).__name__} returned no past_key_values: the engine needs a model that "
                    "keeps a cache (RFC contract: return {'logits', 'past_key_values'}, or a cache-object model)"
                )
            state = _State.of_past(past, width)
        logits = logits_of(output, ops)
        return PrefillGroup(state, valid, valid.sum(axis=1), logits[:, -1], routed)

    def decode(self):
        """One token for every row: (B, V) logits of the new position; its routing too (``routed``)
        when a row's request asked."""
        ops, state = self.ops, self.state
        routes = wants_routes(getattr(row, "request", None) for row in self.rows)
        width = state.width + 1
        valid = np.concatenate([self.valid, np.ones((len(self.rows), 1), dtype=bool)], axis=1)
        kwargs = dict(
            position_ids=ops.asarray(self.positions[:, None], "int64"),
            attention_mask=ops.asarray(decode_mask(valid, width, self.dtype), self.dtype),
        )
        ids = ops.asarray(self.pending[:, None], "int64")
        if self.cache_object:
            cache = DynamicCache(ops, len(self.rows), _UNBOUNDED)
            cache.keys, cache.values = state.keys, state.values
            cache.conv_states, cache.recurrent_states = state.conv, state.recurrent
            cache.seq_length = state.width
            call = functools.partial(self._call, ids, past_key_values=cache, logits_to_keep=1, **kwargs)
            output, self.routed = self._routed(call, np.ones((len(self.rows), 1)), routes)
            cache.advance(1)
            self.state = _State.of_cache(cache)
        else:
            past = [(state.keys[i], state.values[i]) for i in sorted(state.keys)]
            call = functools.partial(self._call, ids, past_key_values=past, **kwargs)
            output, self.routed = self._routed(call, np.ones((len(self.rows), 1)), routes)
            self.state = _State.of_past(past_of(output), width)
        self.valid = valid
        self.positions = self.positions + 1
        return logits_of(output, ops)[:, -1]

    # ---- row operations ----------------------------------------------------------------------
    def join(self, group: PrefillGroup, sources: np.ndarray, rows: List[Any], first_tokens: np.ndarray) -> None:
        """Add ``rows``; row i is a copy of the group's row ``sources[i]`` (n choices share a prompt)."""
        sources = np.asarray(sources, dtype=np.int64)
        self.routed = None if group.routed is None else group.routed[sources]  # ``rows``' first tokens'
        if not rows:
            return
        ops = self.ops
        joining = _State()
        joining.width = group.state.width
        for name, layer, tensor, _ in group.state.tensors():
            joining.set(name, layer, ops.take(tensor, sources, 0))
        valid = group.valid[sources]
        positions = group.lengths[sources].astype(np.int64)
        if self.state is None or not self.rows:
            self.state, self.valid, self.positions = joining, valid, positions
            self.pending = np.asarray(first_tokens, dtype=np.int64)
            self.rows = list(rows)
            return
        width = max(self.state.width, joining.width)
        self._pad_left(self.state, width)
        self._pad_left(joining, width)
        for name, layer, tensor, _ in self.state.tensors():
            self.state.set(name, layer, ops.concat([tensor, getattr(joining, name)[layer]], 0))
        self.valid = np.concatenate([_pad_valid(self.valid, width), _pad_valid(valid, width)], axis=0)
        self.positions = np.concatenate([self.positions, positions])
        self.pending = np.concatenate([self.pending, np.asarray(first_tokens, dtype=np.int64)])
        self.rows.extend(rows)

    def _pad_left(self, state: _State, width: int) -> None:
        extra = width - state.width
        if extra <= 0:
            return
        ops = self.ops
        for name, layer, tensor, columns in state.tensors():
            if columns:
                b, h, _, d = tensor.shape
                state.set(name, layer, ops.concat([ops.zeros((b, h, extra, d), ops.dtype_name(tensor)), tensor], 2))
        state.width = width

    def drop(self, keep: np.ndarray) -> None:
        """Keep the rows at indices ``keep`` (in order), then trim unused leading columns."""
        keep = np.asarray(keep, dtype=np.int64)
        if keep.size == len(self.rows):
            return
        if keep.size == 0:
            self.clear()
            return
        ops, state = self.ops, self.state
        for name, layer, tensor, _ in state.tensors():
            state.set(name, layer, ops.take(tensor, keep, 0))
        self.rows = [self.rows[i] for i in keep]
        self.valid, self.positions, self.pending = self.valid[keep], self.positions[keep], self.pending[keep]
        used = self.valid.any(axis=0)
        first = int(np.argmax(used)) if used.any() else self.valid.shape[1]
        if first:
            for name, layer, tensor, columns in state.tensors():
                if columns:
                    state.set(name, layer, tensor[:, :, first:])
            state.width -= first
            self.valid = self.valid[:, first:]

    def clear(self) -> None:
        self.rows, self.state = [], None
        self.valid = np.zeros((0, 0), dtype=bool)
        self.positions = np.zeros(0, dtype=np.int64)
        self.pending = np.zeros(0, dtype=np.int64)


def wants_routes(requests) -> bool:
    """Whether any of these requests asked for its routed experts."""
    return any(getattr(getattr(request, "params", None), "return_routed_experts", False) for request in requests)


def keep_route(choice, routed: Optional[np.ndarray], row: int) -> None:
    """Row ``row`` of a forward's routing (``RaggedBatch.routed``) appended to ``choice.routes`` when
    its request asked: the routing of the position that chose its latest token."""
    if routed is not None and choice.request.params.return_routed_experts:
        choice.routes.append(routed[row])


def routed_experts(choice) -> Optional[np.ndarray]:
    """(T, moe_layers, top_k) int64: a finished choice's routing, token by token (None if not asked);
    token t's is that of the forward which chose it (its prompt's last position for t = 0)."""
    if not choice.request.params.return_routed_experts:
        return None
    routes = choice.routes
    return np.stack(routes) if routes else np.zeros((0, 0, 0), dtype=np.int64)


def _pad_valid(valid: np.ndarray, width: int) -> np.ndarray:
    return np.pad(valid, ((0, 0), (width - valid.shape[1], 0)))


__all__ = ["RaggedBatch", "PrefillGroup", "wants_routes", "keep_route", "routed_experts"]
