"""BlockPool: ``num_blocks`` fixed blocks of ``block_size`` positions, shared by reference count.

A block is in exactly one of three states:

- **free**: refcount 0, no hash; in the free queue (FIFO), handed out first.
- **used**: refcount > 0, held by that many block tables (the n choices of a request after a
  fork, or requests with the same prefix); it may carry a hash (its content is a cached full
  block, shareable) or not (a block being filled).
- **cached**: refcount 0 with a hash: its K/V is kept for a later prefix hit, in an LRU. It is
  evicted (its hash dropped, ``on_evict`` called) only when the free queue is empty, oldest first.

So ``free + used + cached == num_blocks`` always. Why two queues where vLLM's
``vllm/v1/core/block_pool.py`` has one: vLLM appends every freed block, cached or not, to a single
free queue and evicts a cached block as soon as it reaches the queue's head, so a cached prefix
can be evicted while never-used blocks wait behind it. Keeping never-cached blocks in a queue of
their own means a cached block is only lost when the pool is actually full (SGLang's radix cache
makes the same choice: it evicts only when an allocation needs room). What we keep from vLLM:
a block table frees its blocks tail first (the manager passes them in that order), so within one
sequence the least shareable block, the last, is evicted first and a prefix chain is never left
with a hole before its end; and a cache hit ``touch``es a block, pulling it out of the LRU.

Pure bookkeeping on ints: no framework, no tensors. The K/V memory itself is the engine's, one
preallocated buffer per layer indexed by block id.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Dict, Hashable, Iterable, List, Optional

from . import checks


class NotEnoughBlocks(RuntimeError):
    """``allocate(n)`` asked for more blocks than are free or evictable."""

    def __init__(self, needed: int, available: int, total: int):
        self.needed, self.available, self.total = needed, available, total
        super().__init__(
            f"KV cache pool exhausted: {needed} blocks needed, {available} available (free or evictable) of {total}"
        )


class BlockPool:
    """Free queue, reference counts and the LRU of cached blocks; see the module docstring."""

    def __init__(self, num_blocks: int, block_size: int, on_evict: Optional[Callable[[int, Hashable], None]] = None):
        self.num_blocks = checks.count("num_blocks", num_blocks, minimum=1)
        self.block_size = checks.count("block_size", block_size, minimum=1)
        self._on_evict = on_evict
        self._refcount = [0] * self.num_blocks
        self._hash: List[Optional[Hashable]] = [None] * self.num_blocks
        self._free = deque(range(self.num_blocks))  # refcount 0, no hash
        self._lru: "OrderedDict[int, None]" = OrderedDict()  # refcount 0, hashed; oldest first
        self._by_hash: Dict[Hashable, int] = {}
        self._num_used = 0
        self.evictions = 0

    # -- what a block is -----------------------------------------------------------------------

    def _block(self, block) -> int:
        block = checks.count("block", block)
        if block >= self.num_blocks:
            raise ValueError(f"block must be < num_blocks ({self.num_blocks}), got {block}")
        return block

    def refcount(self, block: int) -> int:
        return self._refcount[self._block(block)]

    def block_hash(self, block: int) -> Optional[Hashable]:
        return self._hash[self._block(block)]

    def lookup(self, block_hash: Hashable) -> Optional[int]:
        """The block holding the cached content of ``block_hash`` (used or idle), else None."""
        return self._by_hash.get(block_hash)

    def free_blocks(self) -> List[int]:
        """The free queue, next to be handed out first."""
        return list(self._free)

    def cached_blocks(self) -> List[int]:
        """The idle cached blocks, next to be evicted first."""
        return list(self._lru)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Idle cached blocks (refcount 0, evictable); used blocks may be hashed too."""
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out now: the free ones, then the evictable cached ones."""
        return len(self._free) + len(self._lru)

    # -- taking and returning blocks -----------------------------------------------------------

    def allocate(self, n: int) -> List[int]:
        """``n`` blocks with refcount 1 and no hash: free ones first, then evicted cached ones,
        oldest first. Raises NotEnoughBlocks (nothing taken) when fewer are available."""
        n = checks.count("n", n)
        if n > self.num_available:
            raise NotEnoughBlocks(n, self.num_available, self.num_blocks)
        taken = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._lru.popitem(last=False)
                self._evict(block)
            self._refcount[block] = 1
            taken.append(block)
        self._num_used += n
        return taken

    def _evict(self, block: int) -> None:
        old = self._hash[block]
        del self._by_hash[old]
        self._hash[block] = None
        self.evictions += 1
        if self._on_evict is not None:
            self._on_evict(block, old)

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in the given order: a block reaching refcount 0
        joins the LRU's young end if it is cached, the free queue otherwise. Pass a table tail
        first, so its last block is evicted before the ones it extends. Freeing a free or idle
        cached block (a double free) raises ValueError before any refcount changes."""
        blocks = [self._block(b) for b in blocks]
        pending: Dict[int, int] = {}
        for block in blocks:
            pending[block] = pending.get(block, 0) + 1
            if pending[block] > self._refcount[block]:
                raise ValueError(f"block {block} freed more times than it is held (refcount {self._refcount[block]})")
        for block in blocks:
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                self._num_used -= 1
                if self._hash[block] is None:
                    self._free.append(block)
                else:
                    self._lru[block] = None

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference to each block: a cache hit on an idle cached block takes it out of
        the LRU; a used block gains a holder (a fork). A free block holds nothing to share:
        ValueError, before any refcount changes."""
        blocks = [self._block(b) for b in blocks]
        for block in blocks:
            if self._refcount[block] == 0 and block not in self._lru:
                raise ValueError(f"block {block} is free: it holds no content to share")
        for block in blocks:
            if self._refcount[block] == 0:
                del self._lru[block]
                self._num_used += 1
            self._refcount[block] += 1

    # -- the hash index ------------------------------------------------------------------------

    def cache(self, block: int, block_hash: Hashable) -> int:
        """Record that used ``block`` holds the full-block content ``block_hash``; returns the
        block now canonical for that hash. If another block already holds the same content (two
        requests computed the same prefix at once, or a hybrid request recomputed past its last
        state snapshot), that one stays canonical and ``block`` stays unhashed: it returns to the
        free queue when freed, so cached hashes stay unique."""
        block = self._block(block)
        if block_hash is None:
            raise ValueError("block_hash must not be None")
        if self._refcount[block] == 0:
            raise ValueError(f"block {block} is not in use: only a computed, held block can be cached")
        current = self._hash[block]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block} is already cached with another hash")
            return block
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            return existing
        self._hash[block] = block_hash
        self._by_hash[block_hash] = block
        return block

    def drop_hashes(self) -> int:
        """Forget every cached content (a weight update made it stale): idle cached blocks become
        free (oldest first), used blocks lose their hash and become free when released. Returns
        how many hashes were dropped. Not counted as evictions."""
        dropped = len(self._by_hash)
        for block in self._by_hash.values():
            self._hash[block] = None
        self._by_hash.clear()
        self._free.extend(self._lru)
        self._lru.clear()
        return dropped
