"""Which slice of each Qwen3.5 weight a tensor-parallel rank holds (Megatron-style), framework-free.

Both backends shard through this one plan, so torch and MindSpore ranks hold the same slices and
a layout that cannot be split fails with the same clear error before any weight is read.

- attention: query(+gate) heads split column-wise; K/V heads split too, or replicated when there
  are fewer KV heads than ranks (each rank keeps the KV head its query heads use); o_proj row-wise.
- Gated DeltaNet: split by key head, each rank keeping the value heads that key head serves:
  the q | k | v segments of in_proj_qkv and of the conv channels, in_proj_z / b / a, A_log and
  dt_bias per value head; out_proj row-wise; the gated norm weight (per head dim) is replicated.
- MLP and experts: gate/up column-wise (intermediate dims), down row-wise; the router and the
  shared-expert gate are replicated.
- vocabulary: embedding rows and LM-head rows split in equal blocks (padded to a multiple of tp);
  logits are vocab-sharded and generate() gathers them before sampling.

Row-parallel outputs (o_proj, out_proj, down_proj, embedding) are summed with one all-reduce.
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
            raise TypeError(f"plan must be a hyper_gen.tensor_parallel.TPPlan or None, got {type(plan).__name__}")
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
            raise ValueError(f"tp={self.tp} must be a multiple of num_key_value_heads={num_kv_heads} "
                             "when there are fewer KV heads than ranks")
        q_start, _ = self.block(num_heads, "num_attention_heads")
        head = q_start // (num_heads // num_kv_heads)
        return head, head + 1

    def vocab(self, vocab_size: int) -> Tuple[int, int]:
        """Rows of the embedding / LM head; the padded size is ``padded_vocab``."""
        size = self.padded_vocab(vocab_size) // self.tp
        return self.rank * size, (self.rank + 1) * size

    def padded_vocab(self, vocab_size: int) -> int:
        return -(-vocab_size // self.tp) * self.tp

    def check(self, config) -> None:
        """Every split this config needs, checked before any weight is read."""
        if self.tp == 1:
            return
        self.block(config.num_attention_heads, "num_attention_heads")
        self.kv_heads(config.num_key_value_heads, config.num_attention_heads)
        self.block(config.linear_num_key_heads, "linear_num_key_heads")
        self.block(config.linear_num_value_heads, "linear_num_value_heads")
        if config.num_experts:
            self.block(config.moe_intermediate_size, "moe_intermediate_size")
            if config.shared_expert_intermediate_size:
                self.block(config.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        else:
            self.block(config.intermediate_size, "intermediate_size")
