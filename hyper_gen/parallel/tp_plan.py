"""``TPPlan``: the even split a tensor-parallel rank holds (Megatron-style), framework- and model-free.

A plan answers "which contiguous block of N heads / dims / vocabulary rows is this rank's",
raising a ValueError naming the field when tp does not divide it. Which weights are split along
which axis is the model family's business (``hyper_gen.models.qwen3_5.shards``), so torch and
MindSpore ranks of one family hold the same slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class TPPlan:
    tp: int = 1
    rank: int = 0

    def __post_init__(self):
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {self.tp!r}")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank must be in [0, tp={self.tp}), got {self.rank}")

    @classmethod
    def resolve(cls, plan) -> "TPPlan":
        """``plan`` itself, or the single-device plan for None; anything else is a TypeError."""
        if plan is None:
            return cls()
        if not isinstance(plan, cls):
            raise TypeError(f"plan must be a hyper_gen.parallel.tp_plan.TPPlan or None, got {type(plan).__name__}")
        return plan

    def block(self, total: int, name: str) -> Tuple[int, int]:
        """This rank's contiguous [start, stop) of ``total`` items split evenly."""
        if total % self.tp:
            raise ValueError(f"tp={self.tp} does not divide {name}={total}")
        size = total // self.tp
        return self.rank * size, (self.rank + 1) * size

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> Tuple[int, int]:
        """KV heads for this rank: a block when they split evenly, else the one its query heads use."""
        if num_kv_heads >= self.tp:
            return self.block(num_kv_heads, "num_key_value_heads")
        if self.tp % num_kv_heads:
            raise ValueError(
                f"tp={self.tp} must be a multiple of num_key_value_heads={num_kv_heads} "
                "when there are fewer KV heads than ranks"
            )
        q_start, _ = self.block(num_heads, "num_attention_heads")
        head = q_start // (num_heads // num_kv_heads)
        return head, head + 1

    def vocab(self, vocab_size: int) -> Tuple[int, int]:
        """Rows of the embedding / LM head; the padded size is ``padded_vocab``."""
        size = self.padded_vocab(vocab_size) // self.tp
        return self.rank * size, (self.rank + 1) * size

    def padded_vocab(self, vocab_size: int) -> int:
        return -(-vocab_size // self.tp) * self.tp
