"""Gated DeltaNet state snapshots: where a hybrid model's prefix can be resumed.

An attention layer's K/V at positions [0, p) can be reused for any p: it is one row a position.
A recurrent layer (Gated DeltaNet's conv window and recurrent matrix) has one state that every
token overwrites, so a cached prefix of p tokens is resumable only if a copy of the state after
exactly p tokens was kept. Reusing a state taken at another position, or none, silently gives
wrong tokens (tpu-inference #3412: gsm8k 0.01 with the cache on, 0.97 off).

So the manager keeps snapshots at block boundaries: every ``state_snapshot_blocks``-th full block
(``k``) may own one slot of this pool, holding the state after that block's last position; a
hybrid hit is the longest cached prefix that ends at a block owning a snapshot. A snapshot
lives and dies with its block (evicted, or dropped by a reset, together), and may be dropped
alone when the slots run out (the block's K/V stays cached: it still serves as the prefix of a
longer, snapshotted hit).

What the others do, and why this shape:

- SGLang's ``MambaRadixCache`` keeps a state only where a request's inserted sequence ended (a
  radix node's ``mamba_value``); splitting a node for a shared prefix leaves the new inner node
  without a state (it cannot be derived from the longer one), and a match stops at the deepest
  node that has one. The common case of one system prompt and different questions then never
  hits, which is the 17.8x TTFT regression of sglang #27220. Evicting a state alone leaves a
  "tombstone" node whose K/V stays; our dropped-alone snapshot is the same idea.
- vLLM's hybrid prefix caching ("align" mode of ``mamba_cache_mode``) keeps the state at block
  boundaries, with one (large) block size for attention and Mamba groups, and looks for the
  last cached block from the right (``MambaManager.find_longest_cache_hit``); its scheduler
  must end prefill chunks at block boundaries, and it refuses to reuse a block cached in the
  same step (the state is not written yet). We keep attention blocks small (16) and take a
  snapshot every ``k`` blocks instead of making every block a state-sized page; a block is
  only hashed after the step that computed it, so the same-step hazard cannot arise.

The slots are bookkeeping only: slot ``i`` indexes the engine's snapshot buffers (one per
DeltaNet layer, on the device, in the state's dtype: float32, float64 in a float64 model).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from . import checks


class SnapshotPool:
    """``num_slots`` state-snapshot slots, each owned by at most one block."""

    def __init__(self, num_slots: int, every_blocks: int):
        self.num_slots = checks.count("num_snapshot_slots", num_slots)
        self.every_blocks = checks.count("state_snapshot_blocks", every_blocks, minimum=1)
        self._free: List[int] = list(range(self.num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._slot_of: Dict[int, int] = {}
        self.evictions = 0  # snapshots dropped alone for room (their block stayed cached)

    def is_boundary(self, num_blocks: int) -> bool:
        """Whether a prefix of ``num_blocks`` full blocks ends where a snapshot may be kept."""
        return num_blocks > 0 and num_blocks % self.every_blocks == 0

    def boundaries(self, start: int, end: int, block_size: int) -> List[int]:
        """The snapshot positions p with start < p <= end: where a step computing positions
        [start, end) must capture the recurrent state (the state after p tokens)."""
        stride = self.every_blocks * block_size
        first = (start // stride + 1) * stride
        return list(range(first, end + 1, stride))

    def slot_of(self, block: int) -> Optional[int]:
        return self._slot_of.get(block)

    def owners(self) -> Dict[int, int]:
        """block -> slot for every held snapshot."""
        return dict(self._slot_of)

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def attach(self, block: int) -> Optional[int]:
        """A free slot for ``block``'s snapshot, or None when every slot is held."""
        if block in self._slot_of:
            raise ValueError(f"block {block} already owns snapshot slot {self._slot_of[block]}")
        if not self._free:
            return None
        slot = self._free.pop()
        self._slot_of[block] = slot
        return slot

    def release(self, block: int) -> Optional[int]:
        """Free ``block``'s slot (its block was evicted or reset); the slot, or None if it had none."""
        slot = self._slot_of.pop(block, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def clear(self) -> int:
        """Free every slot; returns how many were held."""
        held = len(self._slot_of)
        for block in list(self._slot_of):
            self.release(block)
        return held
