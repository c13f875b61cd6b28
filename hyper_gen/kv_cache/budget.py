"""Sizing the pool from a memory budget (``cache_memory_bytes``).

The engine knows what one block costs on its model (every attention layer's K and V rows for
``block_size`` positions, in the cache dtype, on this rank's heads) and what one state snapshot
costs (every Gated DeltaNet layer's recurrent matrix and conv window, float32 or a float64 model's
float64); this module only turns bytes into counts, and says which budget was too small when it
cannot hold one block.
"""

from __future__ import annotations

from . import checks


def kv_bytes_per_block(
    block_size: int, num_attention_layers: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    """Bytes of one block: K and V, every attention layer, ``num_kv_heads`` of this rank."""
    block_size = checks.count("block_size", block_size, minimum=1)
    layers = checks.count("num_attention_layers", num_attention_layers, minimum=1)
    heads = checks.count("num_kv_heads", num_kv_heads, minimum=1)
    head_dim = checks.count("head_dim", head_dim, minimum=1)
    itemsize = checks.count("itemsize", itemsize, minimum=1)
    return 2 * layers * heads * head_dim * block_size * itemsize


def blocks_for_bytes(budget_bytes: int, bytes_per_block: int, name: str = "cache_memory_bytes") -> int:
    """How many whole blocks ``budget_bytes`` holds; ValueError naming the budget (``name``) if
    not even one."""
    budget = checks.count(name, budget_bytes)
    per_block = checks.count("bytes_per_block", bytes_per_block, minimum=1)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"{name}={budget} cannot hold one KV cache block ({per_block} bytes): give at least {per_block}"
        )
    return blocks


def snapshot_slots_for_bytes(budget_bytes: int, bytes_per_snapshot: int, name: str = "snapshot_memory_bytes") -> int:
    """How many state snapshots ``budget_bytes`` holds (0 is allowed: a hybrid model then gets
    no prefix hits, only paging)."""
    budget = checks.count(name, budget_bytes)
    per_snapshot = checks.count("bytes_per_snapshot", bytes_per_snapshot, minimum=1)
    return budget // per_snapshot


# the share of the host's available memory a default pool may take (the weights are already
# loaded when the engine sizes its pool; the rest stays for activations and the process)
DEFAULT_MEMORY_SHARE = 0.25
# the share of a hybrid model's budget its state snapshots may take (the rest holds K/V blocks)
SNAPSHOT_SHARE = 0.25


def available_host_bytes() -> int:
    """The host's available memory (``MemAvailable``), or 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def default_cache_bytes(needed_bytes: int, available_bytes: int) -> int:
    """The default ``cache_memory_bytes``: what the engine's rows could ever use (``needed_bytes``:
    every row at ``max_model_len``, with its snapshots), capped at ``DEFAULT_MEMORY_SHARE`` of the
    available memory (no cap where that is unknown: 0)."""
    needed = checks.count("needed_bytes", needed_bytes, minimum=1)
    available = checks.count("available_bytes", available_bytes)
    return needed if not available else max(1, min(needed, int(available * DEFAULT_MEMORY_SHARE)))


def split_budget(budget_bytes: int, bytes_per_block: int, bytes_per_snapshot: int, every_blocks: int):
    """(blocks, snapshot slots) of a budget: a model without recurrent layers (``bytes_per_snapshot``
    0) puts it all in blocks; a hybrid one gives its snapshots up to ``SNAPSHOT_SHARE`` (at most one
    per ``every_blocks`` blocks: more could never be used)."""
    whole = blocks_for_bytes(budget_bytes, bytes_per_block)  # (a ValueError naming the budget given)
    snapshot_bytes = int(budget_bytes * SNAPSHOT_SHARE)
    blocks = (budget_bytes - snapshot_bytes) // bytes_per_block
    if not bytes_per_snapshot or blocks < 1:
        return whole, 0
    slots = min(snapshot_slots_for_bytes(snapshot_bytes, bytes_per_snapshot), max(blocks // every_blocks, 1))
    return blocks, slots
