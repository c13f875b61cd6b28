"""The engine's cache memory: a K and a V pool per attention layer, Gated DeltaNet state snapshots.

``kv_cache/`` decides which block holds which positions (host ints); this module holds the
tensors those ints index:

- per attention layer, one K and one V pool of ``(num_blocks + 1) * block_size`` slots, each slot
  a (heads, head_dim) row: block ``b`` of the bookkeeping is pool block ``b + 1``, and pool block 0
  is the null block, whose slots every padding column of a gathered table points at (always
  masked; padding tokens of a left-padded prefill write their K/V there too);
- per Gated DeltaNet layer, a slot pool of ``num_rows + 1`` conv windows and recurrent matrices: the
  live states, one slot per running sequence (slot 0 is the null slot, owned by none), so a step
  gathers its rows' states by slot and writes them back in place, whichever rows come or go;
- per Gated DeltaNet layer, ``num_snapshots`` float copies of its conv window and recurrent
  matrix (a prefix ending at a snapshotted block boundary resumes from one).

What the tensors look like (heads on this rank, head_dim, dtype; which layers are attention and
which recurrent) comes from one probe forward of one token at start (``CacheLayout.probe``), so
any model the engine runs (a native port, an RFC model returning its past, a tensor-parallel
rank) is sized by what it actually writes. ``PagedCache`` is the cache object a port's attention
calls ``update`` on: it writes the step's K/V into the pool and returns the rows' gathered K/V.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ..cache import DynamicCache, _ModelCache
from ..drivers import past_of

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
NULL_SLOT = 0  # a slot of the null block: what padding columns read and padding tokens write


class _Tensor(NamedTuple):
    shape: Tuple[int, ...]  # without the batch axis
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * _ITEMSIZE[self.dtype]


class CacheLayout:
    """What one row's cache holds: per attention layer its K and V rows (heads, head_dim) a
    position; per recurrent layer its conv and recurrent state. ``cache_object``: the model takes
    a cache object (a native port) rather than returning its past (RFC contract 1)."""

    def __init__(self, keys: Dict[int, _Tensor], values: Dict[int, _Tensor], conv, recurrent, cache_object: bool):
        self.keys, self.values = keys, values
        self.conv: Dict[int, _Tensor] = conv
        self.recurrent: Dict[int, _Tensor] = recurrent
        self.cache_object = cache_object

    @property
    def hybrid(self) -> bool:
        return bool(self.recurrent)

    def bytes_per_token(self) -> int:
        return sum(t.nbytes for t in (*self.keys.values(), *self.values.values()))

    def bytes_per_state(self) -> int:
        """One row's (or one snapshot's) conv and recurrent states, every recurrent layer."""
        return sum(t.nbytes for t in (*self.conv.values(), *self.recurrent.values()))

    @classmethod
    def probe(cls, model, ops, call) -> "CacheLayout":
        """Run one token through ``model`` (``call(ids, **kwargs)``) and read what its cache holds."""
        dtype = ops.param_dtype(model)
        kwargs = dict(
            position_ids=ops.asarray(np.zeros((1, 1), dtype=np.int64), "int64"),
            attention_mask=ops.asarray(np.zeros((1, 1, 1, 1)), dtype),
        )
        ids = ops.asarray(np.zeros((1, 1), dtype=np.int64), "int64")
        cache_object = bool(getattr(model, "supports_cache_object", False))

        def spec(tensor):
            return _Tensor(tuple(int(n) for n in tensor.shape[1:]), ops.dtype_name(tensor))

        if cache_object:
            cache = DynamicCache(ops, 1, 1 << 40)
            call(ids, past_key_values=cache, logits_to_keep=1, **kwargs)
            keys = {i: _row(spec(t)) for i, t in cache.keys.items()}
            values = {i: _row(spec(t)) for i, t in cache.values.items()}
            conv = {i: spec(t) for i, t in cache.conv_states.items()}
            recurrent = {i: spec(t) for i, t in cache.recurrent_states.items()}
        else:
            past = past_of(call(ids, past_key_values=None, **kwargs))
            if past is None:
                raise TypeError(
                    f"{type(model).__name__} returned no past_key_values: the engine needs a model that keeps a "
                    "cache (RFC contract: return {'logits', 'past_key_values'}, or a cache-object model)"
                )
            keys = {i: _row(spec(pair[0])) for i, pair in enumerate(past)}
            values = {i: _row(spec(pair[1])) for i, pair in enumerate(past)}
            conv, recurrent = {}, {}
        if not keys and not recurrent:
            raise TypeError(f"{type(model).__name__} wrote nothing into its cache on a forward of one token")
        return cls(keys, values, conv, recurrent, cache_object)


def _row(spec: _Tensor) -> _Tensor:
    """(H, T, D) of one row's K or V -> the (H, D) of one slot."""
    heads, _, dim = spec.shape
    return _Tensor((heads, dim), spec.dtype)


class KVStore:
    """The pools of one engine; ``allocate`` / ``release`` (sleep and wake) make and drop them.

    ``num_rows``: the sequences that run at once (``max_num_seqs``), each owning one state slot of
    every Gated DeltaNet layer while it runs (``NULL_SLOT`` is never owned); the runner hands the
    slots out. A step reads its rows' states with one gather a layer and writes them back with one
    index write, so rows come and go without moving any other row's state."""

    def __init__(self, ops, layout: CacheLayout, num_blocks: int, block_size: int, num_snapshots: int, num_rows: int):
        self.ops, self.layout = ops, layout
        self.num_blocks, self.block_size, self.num_snapshots = num_blocks, block_size, num_snapshots
        self.num_rows = num_rows
        self.keys: Dict[int, Any] = {}
        self.values: Dict[int, Any] = {}
        self.conv: Dict[int, Any] = {}  # (num_rows + 1, ...) live states, a slot a running sequence
        self.recurrent: Dict[int, Any] = {}
        self.snapshot_conv: Dict[int, Any] = {}
        self.snapshot_recurrent: Dict[int, Any] = {}

    @property
    def allocated(self) -> bool:
        return bool(self.keys) or bool(self.recurrent)

    def nbytes(self) -> int:
        slots = (self.num_blocks + 1) * self.block_size
        blocks = slots * self.layout.bytes_per_token()
        return blocks + self.num_snapshots * self.layout.bytes_per_state() + self.state_slots_nbytes()

    def state_slots_nbytes(self) -> int:
        """The live-state slot pool: ``num_rows`` slots and the null one, every recurrent layer."""
        return state_slots_nbytes(self.layout, self.num_rows)

    def allocate(self) -> None:
        ops, layout, slots = self.ops, self.layout, (self.num_blocks + 1) * self.block_size
        for store, specs in ((self.keys, layout.keys), (self.values, layout.values)):
            for layer, spec in specs.items():
                store[layer] = ops.buffer((slots,) + spec.shape, spec.dtype)
        pools = [(self.conv, layout.conv, self.num_rows + 1), (self.recurrent, layout.recurrent, self.num_rows + 1)]
        if self.num_snapshots:
            pools += [(self.snapshot_conv, layout.conv, self.num_snapshots)]
            pools += [(self.snapshot_recurrent, layout.recurrent, self.num_snapshots)]
        for store, specs, count in pools:
            for layer, spec in specs.items():
                store[layer] = ops.buffer((count,) + spec.shape, spec.dtype)

    def release(self) -> None:
        for store in (self.keys, self.values, self.conv, self.recurrent, self.snapshot_conv, self.snapshot_recurrent):
            store.clear()

    # ---- slots -----------------------------------------------------------------------------------
    def slots(self, table: List[int], start: int, end: int) -> np.ndarray:
        """The pool slots of positions [start, end) of a sequence with block table ``table``."""
        positions = np.arange(start, end)
        blocks = np.asarray(table, dtype=np.int64)[positions // self.block_size] + 1
        return blocks * self.block_size + positions % self.block_size

    def copy_block(self, src: int, dst: int, positions: int) -> None:
        """Block ``dst`` gets the first ``positions`` rows of block ``src`` (a fork's partial block)."""
        src_slots = self.slots([src], 0, positions)[None]
        dst_slots = self.slots([dst], 0, positions)[None]
        for store in (self.keys, self.values):
            for pool in store.values():
                self.ops.write_slots(pool, dst_slots, self.ops.gather_slots(pool, src_slots))

    # ---- live states -------------------------------------------------------------------------------
    def read_states(self, slots) -> Tuple[Dict[int, Any], Dict[int, Any]]:
        """(conv, recurrent): every recurrent layer's (len(slots), ...) states of ``slots``, gathered."""
        index = np.asarray(slots, dtype=np.int64)
        return (
            {layer: self.ops.take(pool, index, 0) for layer, pool in self.conv.items()},
            {layer: self.ops.take(pool, index, 0) for layer, pool in self.recurrent.items()},
        )

    def write_states(self, slots, conv: Dict[int, Any], recurrent: Dict[int, Any]) -> None:
        """A forward's (len(slots), ...) states into ``slots``, one index write a layer."""
        index = np.asarray(slots, dtype=np.int64)
        for pools, states in ((self.conv, conv), (self.recurrent, recurrent)):
            for layer, state in states.items():
                self.ops.write_rows(pools[layer], index, state)

    def copy_states(self, src: int, dst: List[int]) -> None:
        """Slots ``dst`` get copies of slot ``src``'s states (a prompt forked into its choices)."""
        self.write_states(dst, *self.read_states([src] * len(dst)))

    # ---- state snapshots -------------------------------------------------------------------------
    def save_snapshot(self, snapshot: int, slot: int) -> None:
        """State slot ``slot`` into snapshot ``snapshot``."""
        conv, recurrent = self.read_states([slot])
        for buffers, states in ((self.snapshot_conv, conv), (self.snapshot_recurrent, recurrent)):
            for layer, buffer in buffers.items():
                self.ops.write_rows(buffer, np.asarray([snapshot]), states[layer])

    def load_snapshot(self, snapshot: int, slot: int) -> None:
        """Snapshot ``snapshot`` into state slot ``slot`` (a prefix hit resumes from it)."""
        take = functools.partial(self.ops.take, indices=np.asarray([snapshot]), axis=0)
        conv = {layer: take(buffer) for layer, buffer in self.snapshot_conv.items()}
        recurrent = {layer: take(buffer) for layer, buffer in self.snapshot_recurrent.items()}
        self.write_states([slot], conv, recurrent)


def state_slots_nbytes(layout: CacheLayout, num_rows: int) -> int:
    """Bytes of the live-state slot pool of ``num_rows`` running sequences (and the null slot)."""
    return (num_rows + 1) * layout.bytes_per_state()


class Piece(NamedTuple):
    """Columns of one paged attention piece: the rows that have a position there (None: every row),
    their slots (flat, ``shape`` (rows, columns)), or where each row's attended columns are whole
    pool blocks in order, those blocks (flat, (rows, blocks): a block copies as one run, not a slot
    at a time; None otherwise), and the additive mask (rows, 1, S, columns)."""

    rows: Any
    slots: Any
    shape: Tuple[int, int]
    mask: Any
    blocks: Any = None
    block_size: int = 0


def attention_pieces(
    ops, read: np.ndarray, mask: np.ndarray, columns: int, dtype: str, block_size: int = 0
) -> List[Piece]:
    """The pieces of ``columns`` columns that attention over ``read`` (B, T) slots with the additive
    ``mask`` (B, 1, S, T) reads (``Ops.paged_attention``); a row sits out every piece where the
    mask hides all its columns (the padding up to the longest row). ``block_size``: also name the
    pool blocks of a piece whose attended columns lie block by block in order (a decode of rows of
    one length, a prefill chunk after its own past), ``columns`` being a multiple of it."""
    batch, width = read.shape
    seen = (mask == 0).any(axis=(1, 2))  # (B, T): a column some query of the row attends
    pieces = []
    for start in range(0, width, columns):
        stop = min(start + columns, width)
        rows = np.flatnonzero(seen[:, start:stop].any(axis=1))
        if not len(rows):
            continue
        every = len(rows) == batch
        blocks = _whole_blocks(read[rows, start:stop], seen[rows, start:stop], start, block_size)
        pieces.append(
            Piece(
                None if every else ops.asarray(rows, "int64"),
                ops.asarray(read[rows, start:stop].reshape(-1), "int64"),
                (len(rows), stop - start),
                ops.asarray(mask[rows, :, :, start:stop], dtype),
                None if blocks is None else ops.asarray(blocks.reshape(-1), "int64"),
                block_size,
            )
        )
    return pieces


def _whole_blocks(slots: np.ndarray, seen: np.ndarray, start: int, block_size: int):
    """(rows, blocks) pool blocks whose slots hold ``slots``' attended columns in place (column ``c``
    at offset ``c % block_size``; a block of only masked columns reads the null block), or None."""
    if not block_size or start % block_size:
        return None
    n, t = slots.shape
    count = -(-t // block_size)
    pad = count * block_size - t
    slots = np.pad(slots, ((0, 0), (0, pad)))
    seen = np.pad(seen, ((0, 0), (0, pad)))
    offsets = np.arange(count * block_size) % block_size
    if not ((slots % block_size == offsets) | ~seen).all():
        return None
    owner = np.where(seen, slots // block_size, -1).reshape(n, count, block_size)
    top = owner.max(axis=2)
    if not ((owner == top[..., None]) | (owner < 0)).all():
        return None
    return np.maximum(top, 0)


def in_place_columns(read: np.ndarray, past_valid: np.ndarray, new_valid: np.ndarray):
    """What ``Ops.in_place_attention`` reads for a step over ``read`` (B, W + S) slots: (B, W) past
    columns (``past_valid``: the row's own), then (B, S) new ones, left-padded (``new_valid``).
    Returns each row's attended slots in column order (B, T'), padded with the null slot, and how
    many of them each query attends (B, S): its row's past and its own new columns up to itself, as
    the step's causal mask says (a padding query: none, a zero output nobody reads)."""
    union = np.concatenate([past_valid, new_valid], axis=1).astype(bool)
    counts = union.sum(axis=1)
    order = np.argsort(~union, axis=1, kind="stable")[:, : max(1, int(counts.max()))]
    slots = np.where(np.take_along_axis(union, order, axis=1), np.take_along_axis(read, order, axis=1), NULL_SLOT)
    own = np.cumsum(new_valid, axis=1)  # a valid query's place among its row's new columns, from 1
    lengths = np.where(new_valid, past_valid.sum(axis=1)[:, None] + own, 0)
    return slots, lengths


class PagedCache(_ModelCache):
    """The cache object of one paged forward: ``update`` writes the step's K/V into the pool at
    ``write`` (B, S) and returns the K/V of ``read`` (B, W + S): each row's earlier positions
    (padded with the null slot to the widest row's W), then the step's own columns. The attention
    mask the engine passes covers exactly those columns. Recurrent layers read and write
    ``conv_states`` / ``recurrent_states`` as with any cache object."""

    is_static = False

    def __init__(self, store: KVStore, write: np.ndarray, read: np.ndarray, past_width: int, conv, recurrent):
        super().__init__(store.ops, write.shape[0], 1 << 40)
        self.store, self.write, self.read = store, write, read
        self.seq_length = past_width
        self.conv_states, self.recurrent_states = dict(conv), dict(recurrent)
        self.keys: Dict[int, Any] = {}  # (the contract's attribute; a paged cache keeps K/V in the pool)
        self.values: Dict[int, Any] = {}
        self.pieces: Optional[List[Piece]] = None  # set: ``attend`` reads the pool piece by piece
        # set ((B, T) slots, (B, S) lengths: ``in_place_columns``): ``attend`` reads the pool in
        # place with the backend's kernel when the port gives its softmax scale
        self.in_place = None

    def update(self, key, value, layer_idx: int):
        ops, store = self.ops, self.store
        ops.write_slots(store.keys[layer_idx], self.write, key)
        ops.write_slots(store.values[layer_idx], self.write, value)
        return ops.gather_slots(store.keys[layer_idx], self.read), ops.gather_slots(store.values[layer_idx], self.read)

    def attend(self, query, key, value, mask, layer_idx: int, dense, partial, scale=None):
        in_place = self.in_place is not None and scale is not None
        if self.pieces is None and not in_place:
            return super().attend(query, key, value, mask, layer_idx, dense, partial)
        ops, store = self.ops, self.store
        ops.write_slots(store.keys[layer_idx], self.write, key)
        ops.write_slots(store.values[layer_idx], self.write, value)
        pool_k, pool_v = store.keys[layer_idx], store.values[layer_idx]
        if in_place:
            return ops.in_place_attention(query, pool_k, pool_v, *self.in_place, scale)
        if self.pieces is None:  # a port without a scale: the gathered dense path
            keys, values = ops.gather_slots(pool_k, self.read), ops.gather_slots(pool_v, self.read)
            return dense(query, keys, values, mask)
        return ops.paged_attention(query, pool_k, pool_v, self.pieces, partial)

    def attended_length(self) -> int:
        return self.read.shape[1]


def write_past(store: KVStore, past, write: np.ndarray, past_width: int) -> None:
    """An RFC model's returned past (every layer's (B, H, W + S, D)): its last S columns into the pool."""
    for layer, (key, value) in enumerate(past):
        store.ops.write_slots(store.keys[layer], write, key[:, :, past_width:])
        store.ops.write_slots(store.values[layer], write, value[:, :, past_width:])


def read_past(store: KVStore, read: np.ndarray) -> list:
    """An RFC model's past for a forward: every layer's gathered (B, H, W, D)."""
    ops = store.ops
    return [
        (ops.gather_slots(store.keys[i], read), ops.gather_slots(store.values[i], read)) for i in sorted(store.keys)
    ]


__all__ = [
    "CacheLayout",
    "KVStore",
    "PagedCache",
    "Piece",
    "NULL_SLOT",
    "attention_pieces",
    "in_place_columns",
    "state_slots_nbytes",
    "write_past",
    "read_past",
]
