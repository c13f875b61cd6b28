"""Paged KV cache bookkeeping with automatic prefix caching, Gated DeltaNet snapshots included.

Backend-neutral (no framework: block ids, refcounts and hashes on the host); the engine owns
the K/V buffers, indexed by the block ids this package hands out. One concept a module:

- ``blocks``: ``BlockPool``, the free queue, reference counts and the LRU of cached blocks;
- ``prefix``: the block hash chain and the longest cached prefix (the one-token rule);
- ``snapshots``: ``SnapshotPool``, where a recurrent layer's state was kept (hybrid hits);
- ``budget``: blocks and snapshot slots from a memory budget;
- ``manager``: ``KVCacheManager``, block tables per sequence: admit, append, fork, free, cache.

docs/kv_cache.md has the design and what the engine integration needs.
"""

from .blocks import BlockPool, NotEnoughBlocks
from .budget import (
    available_host_bytes,
    blocks_for_bytes,
    default_cache_bytes,
    kv_bytes_per_block,
    snapshot_slots_for_bytes,
    split_budget,
)
from .manager import Allocation, Fork, KVCacheManager
from .prefix import PrefixCache, hash_block
from .snapshots import SnapshotPool

__all__ = [
    "Allocation",
    "BlockPool",
    "Fork",
    "KVCacheManager",
    "NotEnoughBlocks",
    "PrefixCache",
    "SnapshotPool",
    "available_host_bytes",
    "blocks_for_bytes",
    "default_cache_bytes",
    "split_budget",
    "hash_block",
    "kv_bytes_per_block",
    "snapshot_slots_for_bytes",
]
