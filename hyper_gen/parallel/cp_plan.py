"""Context-parallel bookkeeping, framework- and model-free: which part of a sequence each rank holds.

A context-parallel (CP) model is split along the sequence, not the weights: every rank of the CP
group gets the whole left-padded batch (so generate()'s input check and token agreement work as
for tensor parallelism), prefills only its contiguous slice of the positions, and keeps only that
slice of the attention K/V in its cache.

- **Prefill slices** (:meth:`CPPlan.layout`): the prompt's ``width`` positions (padding included)
  are cut into ``chunk``-position blocks counted from position 0 (Qwen3.5: the 64-position chunks
  of the Gated DeltaNet chunked delta rule, so each rank runs exactly the chunks one device runs,
  with the same arithmetic); rank r gets a contiguous run of whole blocks, as evenly as possible,
  the first ranks one more when they do not divide evenly. The last rank's slice ends at ``width``
  (its last block may be partial) and holds the last token, whose logits every rank returns.
- **Short prompts**: with fewer blocks than ranks some rank would get nothing to compute; then the
  layout is not ``sharded``: every rank prefills the whole (short) prompt, as one device does, and
  still keeps only its slice of K/V (an empty slice for the ranks after the blocks run out).
- **Decode**: every rank computes the new token (the same inputs, the same tokens: replicated);
  its K/V is appended by the **owner**, the last rank (:attr:`CPLayout.owner`), whose cached
  columns are therefore ``[start, current length)``, contiguous; the others keep their prefill
  slice unchanged. Attention over the sharded cache: each rank's partial output and log-sum-exp,
  all-gathered and merged in rank order, the same arithmetic on every rank.

- **Full-attention prefill strategy** (:attr:`CPPlan.strategy`, one of :data:`STRATEGIES`):
  ``"allgather"`` (the default, every backend): one all-gather of every slice's K|V, each rank's
  queries over the whole sequence; ``"ulysses"`` (torch): an all-to-all gives each rank the whole
  sequence of Q, K and V for ``1/cp`` of the heads (:func:`check_ulysses_heads`: the attention and
  KV head counts, after tensor parallelism, must divide by ``cp``), causal attention there, and a
  second all-to-all returns each rank its slice for every head. Either way the cache holds the
  rank's own slice and decode is the same.

The mesh of a ``tp x cp`` job (:class:`Mesh`) puts the tensor-parallel ranks innermost (Megatron's
order): global rank = ``cp_rank * tp + tp_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

STRATEGIES = ("allgather", "ulysses")


def check_strategy(strategy) -> str:
    """``strategy`` if it is one of :data:`STRATEGIES`, else a ValueError naming cp_strategy."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"cp_strategy must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def check_ulysses_heads(cp: int, num_heads: int, num_kv_heads: int) -> None:
    """Ulysses gives each rank ``1/cp`` of the (this tp rank's) attention and KV heads: both must
    divide by ``cp``."""
    for name, count in (("attention", num_heads), ("KV", num_kv_heads)):
        if count % cp:
            raise ValueError(
                f"cp_strategy='ulysses' splits the heads over the cp={cp} ranks, but there are {count} {name} heads "
                f"per tensor-parallel rank ({num_heads} attention, {num_kv_heads} KV), not divisible by cp={cp}; "
                "use cp_strategy='allgather'"
            )


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class CPLayout:
    """How one prompt of ``width`` positions is split over ``cp`` ranks (see the module docstring).

    ``starts[r]:stops[r]`` is rank r's prefill slice; ``sharded`` False means every rank prefills
    the whole prompt (fewer chunks than ranks) and keeps only its slice of K/V."""

    width: int
    cp: int
    starts: Tuple[int, ...]
    stops: Tuple[int, ...]
    sharded: bool

    @property
    def owner(self) -> int:
        """The rank that appends every decode token's K/V: the last one."""
        return self.cp - 1

    def slice_of(self, rank: int) -> Tuple[int, int]:
        return self.starts[rank], self.stops[rank]

    def length_of(self, rank: int) -> int:
        return self.stops[rank] - self.starts[rank]

    @property
    def longest(self) -> int:
        """The longest prefill slice: what an all-gather of per-rank slices pads every slice to."""
        return max(self.stops[r] - self.starts[r] for r in range(self.cp))

    @property
    def last_rank(self) -> int:
        """The rank whose slice holds position ``width - 1`` (the last real token of every row)."""
        return max(r for r in range(self.cp) if self.stops[r] == self.width and self.length_of(r) > 0)

    def cached_columns(self, rank: int, length: int) -> Tuple[int, int]:
        """[start, stop) of the global positions rank ``rank``'s cache holds once ``length``
        positions (prompt + decode tokens) are written: its prefill slice, and for the owner
        everything after its start."""
        start, stop = self.slice_of(rank)
        return (start, length) if rank == self.owner else (start, stop)

    def static_capacity(self, rank: int, max_length: int) -> int:
        """Positions of a static cache's buffer on ``rank``: its slice, plus every decode position
        for the owner (``max_length`` is the whole static cache's length)."""
        start, stop = self.cached_columns(rank, max_length)
        return stop - start


@dataclass(frozen=True)
class CPPlan:
    """This process's place in a context-parallel group: ``cp`` ranks, this one ``rank`` of them;
    ``chunk`` is the block size prefill slices are made of; ``strategy`` how full-attention layers
    exchange the prefill (one of :data:`STRATEGIES`; shown in the repr only when not the default)."""

    cp: int = 1
    rank: int = 0
    chunk: int = 64
    strategy: str = "allgather"

    def __post_init__(self):
        _positive_int(self.cp, "cp")
        _positive_int(self.chunk, "chunk")
        check_strategy(self.strategy)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.cp:
            raise ValueError(f"rank must be in [0, cp={self.cp}), got {self.rank!r}")

    def __repr__(self) -> str:
        extra = "" if self.strategy == "allgather" else f", strategy={self.strategy!r}"
        return f"CPPlan(cp={self.cp}, rank={self.rank}, chunk={self.chunk}{extra})"

    @classmethod
    def resolve(cls, plan) -> "CPPlan":
        """``plan`` itself, or the single-rank plan for None; anything else is a TypeError."""
        if plan is None:
            return cls()
        if not isinstance(plan, cls):
            raise TypeError(f"cp_plan must be a hyper_gen.parallel.cp_plan.CPPlan or None, got {type(plan).__name__}")
        return plan

    def layout(self, width: int) -> CPLayout:
        """The slices of a ``width``-position prompt (see the module docstring)."""
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an int >= 1, got {width!r}")
        blocks = -(-width // self.chunk)
        if blocks < self.cp:  # too short to give every rank a block: replicated prefill
            starts, stops = [], []
            for r in range(self.cp):
                start = min(r * self.chunk, width)
                starts.append(start)
                stops.append(min(start + self.chunk, width))
            return CPLayout(width, self.cp, tuple(starts), tuple(stops), sharded=False)
        base, extra = divmod(blocks, self.cp)
        starts, stops, block = [], [], 0
        for r in range(self.cp):
            count = base + (1 if r < extra else 0)
            starts.append(block * self.chunk)
            block += count
            stops.append(min(block * self.chunk, width))
        return CPLayout(width, self.cp, tuple(starts), tuple(stops), sharded=True)


@dataclass(frozen=True)
class Mesh:
    """A ``tp x cp`` job: global rank = ``cp_rank * tp + tp_rank`` (tensor parallelism innermost)."""

    tp: int = 1
    cp: int = 1

    def __post_init__(self):
        _positive_int(self.tp, "tp")
        _positive_int(self.cp, "cp")

    @property
    def size(self) -> int:
        return self.tp * self.cp

    def coordinates(self, rank: int) -> Tuple[int, int]:
        """(tp_rank, cp_rank) of a global rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, tp * cp = {self.size}), got {rank}")
        return rank % self.tp, rank // self.tp

    def tp_groups(self) -> List[List[int]]:
        """The global ranks of every tensor-parallel group (one per cp rank), in group order."""
        return [[c * self.tp + t for t in range(self.tp)] for c in range(self.cp)]

    def cp_groups(self) -> List[List[int]]:
        """The global ranks of every context-parallel group (one per tp rank), in group order."""
        return [[c * self.tp + t for c in range(self.cp)] for t in range(self.tp)]
