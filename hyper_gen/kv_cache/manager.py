"""KVCacheManager: block tables per sequence over one BlockPool, with automatic prefix caching.

What the engine does with it, one step at a time (single thread, the engine's):

1. Admission: ``allocate_for(request_id, prompt, new_tokens)`` finds the longest cached prefix
   (for a hybrid model, one ending at a state snapshot), shares its blocks and allocates the
   rest for the ``new_tokens`` this step computes (a prefill chunk; None for the whole rest).
   It returns None, taking nothing, when the pool cannot hold them now: the request waits.
2. Each later chunk and each decode token: ``append(request_id, n)`` grows the table; False
   (nothing taken) when the pool is exhausted, so the engine preempts its youngest request
   (``free``, then ``allocate_for`` again later with prompt + generated tokens: the blocks it
   had computed are likely still cached, vLLM's recompute preemption at a lower price).
3. After the step: ``cache_full_blocks(request_id, tokens)`` hashes the blocks that step
   completed, so later requests can hit them; for a hybrid model it also says which snapshot
   slot each captured state must be copied into (``{position: slot}``).
4. n choices: ``fork(parent_id, child_id)`` after the prompt's step shares every full block
   copy-free (refcount + 1); the partly filled last block cannot be shared (both would write
   their next token into it), so the child gets a new block and the engine copies the parent's
   first ``positions`` rows of it (``Fork.copy``: one slice copy per attention layer).
5. ``free(request_id)``: the table is released tail first; hashed blocks stay cached (LRU).

Stats count tokens as vLLM's ``PrefixCacheStats`` does: ``prefix_cache_queries`` the prompt
tokens of admitted requests, ``prefix_cache_hits`` the ones found computed. An admission that
did not fit is not counted (it is asked again next step).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, NamedTuple, Optional, Tuple

from . import checks
from .blocks import BlockPool
from .prefix import PrefixCache
from .snapshots import SnapshotPool

DEFAULT_STATE_SNAPSHOT_BLOCKS = 4  # 64 positions at block_size 16: the chunked delta rule's chunk


class Allocation(NamedTuple):
    block_table: List[int]  # the sequence's blocks, position p is in block_table[p // block_size]
    num_computed_tokens: int  # the prefix hit: positions [0, n) are computed, skip them
    num_new_tokens: int  # positions [n, n + num_new_tokens) have slots: compute them this step
    snapshot_slot: Optional[int]  # hybrid hit: load the recurrent state from this slot (copy it)


class Fork(NamedTuple):
    block_table: List[int]
    copy: Optional[Tuple[int, int, int]]  # (src_block, dst_block, positions) to copy, or None


@dataclass
class _Sequence:
    table: List[int]
    num_tokens: int  # positions with a slot: computed, or being computed this step
    hashes: List[bytes]  # the chain of its full blocks, as far as known
    num_cached: int  # leading blocks already handed to the cache
    epoch: int  # the cache epoch it was admitted in (a reset makes it uncacheable)


class KVCacheManager:
    """Paged KV bookkeeping for the engine; see the module docstring.

    ``hybrid``: the model has recurrent (Gated DeltaNet) layers, so a prefix is reused only up
    to a block owning a state snapshot; every ``state_snapshot_blocks``-th block boundary may
    own one, from ``num_snapshot_slots`` slots (default: one per ``state_snapshot_blocks``
    blocks). ``extra_key``: what else the K/V depends on (a weight version); ``reset`` changes it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        state_snapshot_blocks: int = DEFAULT_STATE_SNAPSHOT_BLOCKS,
        hybrid: bool = False,
        num_snapshot_slots: Optional[int] = None,
        extra_key=None,
    ):
        for name, flag in (("enable_prefix_caching", enable_prefix_caching), ("hybrid", hybrid)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        self.pool = BlockPool(num_blocks, block_size, on_evict=self._evicted)
        self.block_size = self.pool.block_size
        self.num_blocks = self.pool.num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.hybrid = hybrid
        every = checks.count("state_snapshot_blocks", state_snapshot_blocks, minimum=1)
        if num_snapshot_slots is None:
            num_snapshot_slots = self.num_blocks // every if hybrid else 0
        self.snapshots = SnapshotPool(num_snapshot_slots, every)
        self.prefix = PrefixCache(self.pool, extra_key)
        self._sequences: Dict[Hashable, _Sequence] = {}
        self._epoch = 0
        self._queries = 0
        self._hits = 0

    # -- sizes ---------------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        num_tokens = checks.count("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, tokens) -> bool:
        """Whether a sequence of ``tokens`` positions (an int: prompt + max_new_tokens, or the
        token ids) fits the pool even alone; the engine refuses one that does not at submit."""
        n = tokens if isinstance(tokens, numbers.Integral) else len(checks.token_ids("tokens", tokens))
        return self.blocks_needed(n) <= self.num_blocks

    @property
    def num_available_blocks(self) -> int:
        return self.pool.num_available

    # -- sequences -----------------------------------------------------------------------------

    def _sequence(self, request_id) -> _Sequence:
        request_id = checks.request_id(request_id)
        seq = self._sequences.get(request_id)
        if seq is None:
            raise ValueError(f"request_id {request_id!r} holds no blocks (unknown, or already freed)")
        return seq

    def _new_id(self, request_id) -> Hashable:
        request_id = checks.request_id(request_id)
        if request_id in self._sequences:
            raise ValueError(f"request_id {request_id!r} already holds blocks: free it first")
        return request_id

    def requests(self) -> List[Hashable]:
        return list(self._sequences)

    def block_table(self, request_id) -> List[int]:
        return list(self._sequence(request_id).table)

    def num_tokens(self, request_id) -> int:
        return self._sequence(request_id).num_tokens

    def tables(self) -> Dict[Hashable, List[int]]:
        """Every live sequence's block table (copies)."""
        return {rid: list(seq.table) for rid, seq in self._sequences.items()}

    def _snapshot_usable(self, num_blocks: int, block: int) -> bool:
        return self.snapshots.is_boundary(num_blocks) and self.snapshots.slot_of(block) is not None

    def allocate_for(
        self, request_id, tokens, new_tokens: Optional[int] = None, lookup: bool = True
    ) -> Optional[Allocation]:
        """Admit a sequence of ``tokens`` (the prompt; after a preemption, prompt + generated):
        share its longest cached prefix and give slots to the next ``new_tokens`` positions
        (at most; None: all the rest). None, with nothing taken, if the pool cannot hold them.
        ``lookup=False``: compute every position (a request that wants each prompt position's
        logits), though its blocks are still cached for later requests."""
        request_id = self._new_id(request_id)
        ids = checks.token_ids("tokens", tokens)
        if len(ids) == 0:
            raise ValueError("tokens must hold at least one token id, got an empty sequence")
        if new_tokens is not None:
            new_tokens = checks.count("new_tokens", new_tokens, minimum=1)
        hashes: List[bytes] = []
        hit: List[int] = []
        if self.enable_prefix_caching:
            hashes = self.prefix.block_hashes(ids)
            usable = self._snapshot_usable if self.hybrid else None
            hit = self.prefix.find_longest_prefix(ids, hashes, usable=usable) if lookup else []
        computed = len(hit) * self.block_size
        remaining = len(ids) - computed
        scheduled = remaining if new_tokens is None else min(new_tokens, remaining)
        needed = self.blocks_needed(computed + scheduled) - len(hit)
        reclaimed = sum(1 for block in hit if self.pool.refcount(block) == 0)  # leave the LRU when touched
        if needed + reclaimed > self.pool.num_available:
            return None
        self.pool.touch(hit)  # before allocating: the allocation must not evict the hit
        table = hit + self.pool.allocate(needed)
        self._sequences[request_id] = _Sequence(table, computed + scheduled, hashes, len(hit), self._epoch)
        if self.enable_prefix_caching:
            self._queries += len(ids)
            self._hits += computed
        slot = self.snapshots.slot_of(hit[-1]) if (self.hybrid and hit) else None
        return Allocation(list(table), computed, scheduled, slot)

    def append(self, request_id, n: int = 1) -> bool:
        """Slots for ``n`` more positions (the next prefill chunk, or a decode token); False,
        with nothing taken, when the pool cannot give the blocks that needs."""
        seq = self._sequence(request_id)
        n = checks.count("n", n)
        needed = self.blocks_needed(seq.num_tokens + n) - len(seq.table)
        if needed > self.pool.num_available:
            return False
        seq.table.extend(self.pool.allocate(needed))
        seq.num_tokens += n
        return True

    def fork(self, parent_id, child_id) -> Optional[Fork]:
        """The child shares the parent's full blocks; a partly filled last block is given to the
        child as a new block to copy the parent's rows into (``Fork.copy``; for a hybrid model
        the engine copies the parent's live recurrent state as well). Call it after the step
        that computed the parent's positions. None, with nothing taken, if no block is free for
        the copy."""
        parent = self._sequence(parent_id)
        child_id = self._new_id(child_id)
        full, partial = divmod(parent.num_tokens, self.block_size)
        if partial and self.pool.num_available < 1:
            return None
        shared = parent.table[:full]
        self.pool.touch(shared)
        table = list(shared)
        copy = None
        if partial:
            (block,) = self.pool.allocate(1)
            table.append(block)
            copy = (parent.table[full], block, partial)
        self._sequences[child_id] = _Sequence(
            table, parent.num_tokens, list(parent.hashes), min(parent.num_cached, full), parent.epoch
        )
        return Fork(list(table), copy)

    def free(self, request_id) -> None:
        """Release the sequence's blocks, tail first; its cached full blocks stay for reuse."""
        seq = self._sequence(request_id)
        del self._sequences[request_id]
        self.pool.free(reversed(seq.table))

    # -- caching -------------------------------------------------------------------------------

    def snapshot_positions(self, start: int, end: int) -> List[int]:
        """For a hybrid model: the positions in (start, end] whose recurrent state a step
        computing positions [start, end) must capture (then ``cache_full_blocks`` gives slots)."""
        start = checks.count("start", start)
        end = checks.count("end", end)
        if not self.hybrid or not self.enable_prefix_caching:
            return []
        return self.snapshots.boundaries(start, end, self.block_size)

    def cache_full_blocks(
        self, request_id, tokens, snapshot_positions: Optional[Iterable[int]] = None
    ) -> Dict[int, int]:
        """After a step computed ``tokens`` (the sequence so far, prompt + generated): hash the
        full blocks it completed, so later requests hit them. For a hybrid model, returns
        ``{position: slot}``: copy the state captured after ``position`` tokens into ``slot``
        now, before any other admission (``snapshot_positions`` names those captured; None:
        every boundary ``snapshot_positions(start, end)`` named). ``{}`` otherwise."""
        seq = self._sequence(request_id)
        ids = checks.token_ids("tokens", tokens)
        if len(ids) > seq.num_tokens:
            raise ValueError(f"tokens has {len(ids)} positions but request_id {request_id!r} holds {seq.num_tokens}")
        if not self.enable_prefix_caching or seq.epoch != self._epoch:
            return {}
        full = len(ids) // self.block_size
        if full <= seq.num_cached:
            return {}
        seq.hashes = self.prefix.block_hashes(ids, known=seq.hashes[: min(len(seq.hashes), full)])
        wanted = None if snapshot_positions is None else {checks.count("position", p) for p in snapshot_positions}
        slots: Dict[int, int] = {}
        for i in range(seq.num_cached, full):
            canonical = self.pool.cache(seq.table[i], seq.hashes[i])
            position = (i + 1) * self.block_size
            if not (self.hybrid and self.snapshots.is_boundary(i + 1)):
                continue
            if (wanted is not None and position not in wanted) or self.snapshots.slot_of(canonical) is not None:
                continue
            slot = self._take_slot(canonical)
            if slot is not None:
                slots[position] = slot
        seq.num_cached = full
        return slots

    def _take_slot(self, block: int) -> Optional[int]:
        slot = self.snapshots.attach(block)
        if slot is not None:
            return slot
        for idle in self.pool.cached_blocks():  # oldest first: drop its snapshot, keep its K/V
            if idle != block and self.snapshots.slot_of(idle) is not None:
                self.snapshots.release(idle)
                self.snapshots.evictions += 1
                return self.snapshots.attach(block)
        return None

    def _evicted(self, block: int, block_hash) -> None:
        self.snapshots.release(block)

    def reset(self, extra_key=None) -> int:
        """Drop the whole prefix cache (a weight update: nothing computed before it may be
        served after), hash from now on with ``extra_key``; sequences still running are never
        cached (their K/V mixes both weights). Returns how many cached blocks were dropped."""
        dropped = self.prefix.reset(extra_key)
        self.snapshots.clear()
        self._epoch += 1
        return dropped

    def stats(self) -> Dict[str, int]:
        return {
            "blocks_total": self.num_blocks,
            "blocks_used": self.pool.num_used,
            "blocks_cached": self.pool.num_cached,
            "blocks_free": self.pool.num_free,
            "prefix_cache_queries": self._queries,
            "prefix_cache_hits": self._hits,
            "evictions": self.pool.evictions,
            "snapshots_total": self.snapshots.num_slots,
            "snapshots_used": self.snapshots.num_used,
            "snapshot_evictions": self.snapshots.evictions,
            "requests": len(self._sequences),
        }
