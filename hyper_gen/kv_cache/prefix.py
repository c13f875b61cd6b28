"""The block hash chain and the longest cached prefix of a token sequence.

A full block's hash covers its parent's hash, an extra key and its own token ids, so equal
hashes mean equal tokens *at the same depth after the same prefix*: the same 16 tokens after a
different prefix, or at a different position, never hit (their K/V differ: attention read a
different past, rotary a different position). The extra key is whatever else the K/V depends
on: a LoRA / weight version. ``reset(extra_key)`` drops every cached hash and changes the key,
so nothing computed under old weights is served after a weight update.

Why sha256 over the bytes and not Python's ``hash``: ``hash(str)`` is salted per process, so
tensor-parallel ranks (one process each) or a future cache shared across processes would
disagree, and a 64-bit tuple hash can collide, which would serve another prompt's K/V silently.
vLLM made sha256 its default block hash for the same reason (``kv_cache_utils.hash_block_tokens``
takes parent hash, token ids and extra keys the same way). Only full blocks are hashed: a
partial block's content is still growing.

The one-token rule (vLLM's ``get_computed_blocks`` caps the hit at ``num_tokens - 1``): the step
that admits a request must compute at least its last token, since that forward is what yields
the logits of the first new token. A prompt cached whole still recomputes its last token, so a
hit is at most ``(len(tokens) - 1) // block_size`` blocks.
"""

from __future__ import annotations

import hashlib
from typing import Callable, List, Optional, Sequence

from . import checks
from .blocks import BlockPool

ROOT_HASH = hashlib.sha256(b"hyper_gen.kv_cache block hash v1").digest()  # the first block's parent


def _key_bytes(extra_key) -> bytes:
    """A deterministic encoding of the extra key (no object reprs, which hold addresses)."""

    def allowed(value) -> bool:
        if isinstance(value, tuple):
            return all(allowed(v) for v in value)
        return value is None or isinstance(value, (str, bytes, int))

    if not allowed(extra_key):
        raise TypeError(f"extra_key must be None, str, bytes, int or a tuple of those, got {extra_key!r}")
    return repr(extra_key).encode("utf-8")


def hash_block(parent: Optional[bytes], tokens, extra_key=None) -> bytes:
    """The hash of one block: sha256 of the parent's hash (``ROOT_HASH`` for the first block),
    the length-prefixed extra key and the token ids as little-endian int64."""
    ids = checks.token_ids("tokens", tokens)
    key = _key_bytes(extra_key)
    digest = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    digest.update(len(key).to_bytes(4, "little"))
    digest.update(key)
    digest.update(ids.astype("<i8", copy=False).tobytes())
    return digest.digest()


class PrefixCache:
    """The hash chain of a pool's block size, and lookups of cached prefixes in that pool."""

    def __init__(self, pool: BlockPool, extra_key=None):
        _key_bytes(extra_key)
        self.pool = pool
        self.block_size = pool.block_size
        self.extra_key = extra_key

    def block_hashes(self, tokens, known: Sequence[bytes] = ()) -> List[bytes]:
        """The hashes of every full block of ``tokens``; the first ``len(known)`` are taken as
        given (a sequence's chain grows as it decodes: only the new blocks are hashed)."""
        ids = checks.token_ids("tokens", tokens)
        full = len(ids) // self.block_size
        if len(known) > full:
            raise ValueError(f"known holds {len(known)} hashes but tokens has only {full} full blocks")
        hashes = list(known)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), full):
            parent = hash_block(parent, ids[i * self.block_size : (i + 1) * self.block_size], self.extra_key)
            hashes.append(parent)
        return hashes

    def max_hit_blocks(self, num_tokens: int) -> int:
        """The most blocks a hit may cover under the one-token rule."""
        num_tokens = checks.count("num_tokens", num_tokens)
        return max(num_tokens - 1, 0) // self.block_size

    def find_longest_prefix(
        self,
        tokens,
        hashes: Optional[Sequence[bytes]] = None,
        usable: Optional[Callable[[int, int], bool]] = None,
    ) -> List[int]:
        """The cached blocks of the longest full-block prefix of ``tokens`` (at most
        ``max_hit_blocks``), in order; ``[]`` on a miss. ``usable(num_blocks, last_block)`` cuts
        the hit back to the longest prefix it accepts (a hybrid model: one ending at a block that
        holds a state snapshot). Does not take references: ``pool.touch`` the result before
        allocating anything, or an allocation may evict it."""
        ids = checks.token_ids("tokens", tokens)
        limit = self.max_hit_blocks(len(ids))
        if hashes is None:
            hashes = self.block_hashes(ids[: limit * self.block_size])
        blocks: List[int] = []
        for block_hash in hashes[:limit]:
            block = self.pool.lookup(block_hash)
            if block is None:  # a chain: nothing after a miss can be cached for this prefix
                break
            blocks.append(block)
        if usable is not None:
            while blocks and not usable(len(blocks), blocks[-1]):
                blocks.pop()
        return blocks

    def reset(self, extra_key=None) -> int:
        """Drop every cached hash in the pool and hash from now on with ``extra_key``; returns
        how many cached blocks were dropped."""
        _key_bytes(extra_key)
        self.extra_key = extra_key
        return self.pool.drop_hashes()
