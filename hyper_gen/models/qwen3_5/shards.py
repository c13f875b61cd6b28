"""What each Qwen3.5 weight is called in the checkpoint and which part of it a rank reads, as data.

Both ports (``hyper_gen.backends.<framework>.models.qwen3_5``) read their weights only through
these descriptions, so a slicing or naming bug is fixed once and torch and MindSpore ranks hold
the same slices. Every ``Piece`` names a checkpoint tensor, its full shape (checked on read by
``Checkpoint.read``) and the ranges of it this rank keeps; a port then lays the arrays out as its
kernels want them (fused, transposed, norm-folded).

The tensor-parallel split (Megatron-style, ``TPPlan(tp, rank)``; at tp 1 every range is whole):

- attention: query(+gate) heads split column-wise, each head's rows [query (D) | gate (D)]; K/V
  heads split too, or replicated when there are fewer KV heads than ranks (each rank keeps the KV
  head its query heads use); o_proj row-wise (its input columns), summed over ranks.
- Gated DeltaNet: split by key head, each rank keeping the value heads those key heads serve:
  the q | k | v segments of in_proj_qkv and of the conv channels, in_proj_z / b / a, A_log and
  dt_bias per value head; out_proj row-wise; the gated norm weight (per head dim) replicated.
- MLP and experts: gate/up column-wise (intermediate dims), down row-wise; the router and the
  shared-expert gate replicated.
- vocabulary: embedding and LM-head rows in equal blocks (padded to a multiple of tp with zero
  rows); logits are vocab-sharded and generate() gathers them before sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np

from hyper_gen.models.checkpoint import Checkpoint, Piece
from hyper_gen.parallel.tp_plan import TPPlan

from .config import Qwen3_5Config

EMBED_TOKENS = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


def check_tp(plan: TPPlan, config: Qwen3_5Config) -> None:
    """Every split this config needs under ``plan``, checked before any weight is read."""
    if plan.tp == 1:
        return
    plan.block(config.num_attention_heads, "num_attention_heads")
    plan.kv_heads(config.num_key_value_heads, config.num_attention_heads)
    plan.block(config.linear_num_key_heads, "linear_num_key_heads")
    plan.block(config.linear_num_value_heads, "linear_num_value_heads")
    if config.is_moe:
        plan.block(config.moe_intermediate_size, "moe_intermediate_size")
        if config.shared_expert_intermediate_size:
            plan.block(config.shared_expert_intermediate_size, "shared_expert_intermediate_size")
    else:
        plan.block(config.intermediate_size, "intermediate_size")


def _whole(name: str, shape) -> Piece:
    return Piece(name, tuple(shape))


def _part(name: str, shape, axis: int, *ranges: Tuple[int, int]) -> Piece:
    return Piece(name, tuple(shape), axis, tuple(ranges))


@dataclass(frozen=True)
class AttentionShard:
    """Gated full attention; head counts are this rank's."""

    num_heads: int
    num_kv_heads: int
    query_gate: Piece  # (2 * num_heads * D, hidden): per head [query rows | gate rows]
    key: Piece  # (num_kv_heads * D, hidden)
    value: Piece
    o_proj: Piece  # (hidden, num_heads * D): this rank's input columns
    q_norm: Piece  # (D,)
    k_norm: Piece


def attention(config: Qwen3_5Config, plan: TPPlan, prefix: str) -> AttentionShard:
    h, kv, d, hid = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
    q_start, q_stop = plan.block(h, "num_attention_heads")
    kv_start, kv_stop = plan.kv_heads(kv, h)
    kv_rows = (kv_start * d, kv_stop * d)
    return AttentionShard(
        num_heads=q_stop - q_start,
        num_kv_heads=kv_stop - kv_start,
        query_gate=_part(f"{prefix}.q_proj.weight", (2 * h * d, hid), 0, (2 * d * q_start, 2 * d * q_stop)),
        key=_part(f"{prefix}.k_proj.weight", (kv * d, hid), 0, kv_rows),
        value=_part(f"{prefix}.v_proj.weight", (kv * d, hid), 0, kv_rows),
        o_proj=_part(f"{prefix}.o_proj.weight", (hid, h * d), 1, (q_start * d, q_stop * d)),
        q_norm=_whole(f"{prefix}.q_norm.weight", (d,)),
        k_norm=_whole(f"{prefix}.k_norm.weight", (d,)),
    )


@dataclass(frozen=True)
class GatedDeltaNetShard:
    """Gated DeltaNet; head counts are this rank's. ``qkv`` and ``conv`` hold the same channels:
    this rank's q | k | v segments of the checkpoint's [q | k | v] layout, in that order."""

    num_k_heads: int
    num_v_heads: int
    qkv: Piece  # rows of in_proj_qkv (conv channels, hidden)
    z: Piece  # (num_v_heads * Dv, hidden)
    b: Piece  # (num_v_heads, hidden)
    a: Piece
    conv: Piece  # (conv channels, 1, kernel)
    a_log: Piece  # (num_v_heads,)
    dt_bias: Piece
    norm: Piece  # (Dv,), replicated
    out_proj: Piece  # (hidden, num_v_heads * Dv): this rank's input columns


def gated_deltanet(config: Qwen3_5Config, plan: TPPlan, prefix: str) -> GatedDeltaNetShard:
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, hid = config.linear_key_head_dim, config.linear_value_head_dim, config.hidden_size
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    k_start, k_stop = plan.block(hk, "linear_num_key_heads")
    v_start, v_stop = plan.block(hv, "linear_num_value_heads")  # the value heads those key heads serve
    channels = (
        (k_start * dk, k_stop * dk),  # q
        (key_dim + k_start * dk, key_dim + k_stop * dk),  # k
        (2 * key_dim + v_start * dv, 2 * key_dim + v_stop * dv),  # v
    )
    values, heads = (v_start * dv, v_stop * dv), (v_start, v_stop)
    kernel = config.linear_conv_kernel_dim
    return GatedDeltaNetShard(
        num_k_heads=k_stop - k_start,
        num_v_heads=v_stop - v_start,
        qkv=_part(f"{prefix}.in_proj_qkv.weight", (conv_dim, hid), 0, *channels),
        z=_part(f"{prefix}.in_proj_z.weight", (value_dim, hid), 0, values),
        b=_part(f"{prefix}.in_proj_b.weight", (hv, hid), 0, heads),
        a=_part(f"{prefix}.in_proj_a.weight", (hv, hid), 0, heads),
        conv=_part(f"{prefix}.conv1d.weight", (conv_dim, 1, kernel), 0, *channels),
        a_log=_part(f"{prefix}.A_log", (hv,), 0, heads),
        dt_bias=_part(f"{prefix}.dt_bias", (hv,), 0, heads),
        norm=_whole(f"{prefix}.norm.weight", (dv,)),
        out_proj=_part(f"{prefix}.out_proj.weight", (hid, value_dim), 1, values),
    )


@dataclass(frozen=True)
class MLPShard:
    """A SwiGLU MLP with this rank's block of the intermediate dims."""

    intermediate: int  # local
    gate: Piece  # (inter, hidden): rows
    up: Piece
    down: Piece  # (hidden, inter): columns


def mlp(prefix: str, hidden: int, inter: int, field: str, plan: TPPlan) -> MLPShard:
    """``field``: the config field ``inter`` comes from (named when tp does not divide it)."""
    block = plan.block(inter, field)
    return MLPShard(
        intermediate=block[1] - block[0],
        gate=_part(f"{prefix}.gate_proj.weight", (inter, hidden), 0, block),
        up=_part(f"{prefix}.up_proj.weight", (inter, hidden), 0, block),
        down=_part(f"{prefix}.down_proj.weight", (hidden, inter), 1, block),
    )


@dataclass(frozen=True)
class FusedExperts:
    """All experts in HF's in-memory layout: ``experts.gate_up_proj`` (E, 2I, H), gate rows first,
    and ``experts.down_proj`` (E, H, I)."""

    gate: Piece  # (E, 2I, H) along axis 1: this rank's gate rows of every expert
    up: Piece  # this rank's up rows of every expert
    down: Piece  # (E, H, I) along axis 2


@dataclass(frozen=True)
class MoEShard:
    num_experts: int
    top_k: int
    router: Piece  # (E, hidden), replicated
    shared_expert_gate: Piece  # (1, hidden), replicated
    shared_expert: MLPShard
    experts: Union[FusedExperts, Tuple[MLPShard, ...]]  # fused, or per expert (save_pretrained's layout)
    intermediate: int  # this rank's block of each expert's moe_intermediate_size (local, like MLPShard's)


def moe(config: Qwen3_5Config, plan: TPPlan, prefix: str, fused: bool) -> MoEShard:
    e, hid, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    start, stop = plan.block(inter, "moe_intermediate_size")
    if fused:
        gate_up = (e, 2 * inter, hid)
        experts = FusedExperts(
            gate=_part(f"{prefix}.experts.gate_up_proj", gate_up, 1, (start, stop)),
            up=_part(f"{prefix}.experts.gate_up_proj", gate_up, 1, (inter + start, inter + stop)),
            down=_part(f"{prefix}.experts.down_proj", (e, hid, inter), 2, (start, stop)),
        )
    else:
        experts = tuple(mlp(f"{prefix}.experts.{i}", hid, inter, "moe_intermediate_size", plan) for i in range(e))
    return MoEShard(
        num_experts=e,
        top_k=config.num_experts_per_tok,
        router=_whole(f"{prefix}.gate.weight", (e, hid)),
        shared_expert_gate=_whole(f"{prefix}.shared_expert_gate.weight", (1, hid)),
        shared_expert=mlp(
            f"{prefix}.shared_expert",
            hid,
            config.shared_expert_intermediate_size,
            "shared_expert_intermediate_size",
            plan,
        ),
        experts=experts,
        intermediate=stop - start,
    )


@dataclass(frozen=True)
class LayerShard:
    is_linear: bool  # Gated DeltaNet (True) or gated full attention
    input_norm: Piece  # (hidden,)
    post_attention_norm: Piece
    mixer: Union[AttentionShard, GatedDeltaNetShard]
    mlp: Union[MLPShard, MoEShard]


def layer(config: Qwen3_5Config, plan: TPPlan, index: int, fused_experts: bool = False) -> LayerShard:
    p, hid = f"model.layers.{index}", config.hidden_size
    is_linear = config.layer_types[index] == "linear_attention"
    mixer = gated_deltanet(config, plan, f"{p}.linear_attn") if is_linear else attention(config, plan, f"{p}.self_attn")
    if config.is_moe:
        feed_forward = moe(config, plan, f"{p}.mlp", fused_experts)
    else:
        feed_forward = mlp(f"{p}.mlp", hid, config.intermediate_size, "intermediate_size", plan)
    return LayerShard(
        is_linear=is_linear,
        input_norm=_whole(f"{p}.input_layernorm.weight", (hid,)),
        post_attention_norm=_whole(f"{p}.post_attention_layernorm.weight", (hid,)),
        mixer=mixer,
        mlp=feed_forward,
    )


@dataclass(frozen=True)
class ModelShard:
    """The whole text model for one rank; the embedding and LM head are read by ``vocab_rows``."""

    config: Qwen3_5Config
    plan: TPPlan
    vocab_start: int  # this rank's padded block of the vocabulary: [vocab_start, vocab_stop)
    vocab_stop: int
    lm_head: Optional[str]  # None when tied to the embedding
    final_norm: Piece
    layers: Tuple[LayerShard, ...]


def describe(checkpoint: Checkpoint, config: Qwen3_5Config, plan: Optional[TPPlan] = None) -> ModelShard:
    """Every piece of ``checkpoint`` this rank reads (``plan`` None: the whole model), the splits
    checked first. MoE experts are read from the fused layout when the checkpoint has it."""
    plan = TPPlan.resolve(plan)
    check_tp(plan, config)
    fused = config.is_moe and checkpoint.has("model.layers.0.mlp.experts.gate_up_proj")
    start, stop = plan.vocab(config.vocab_size)
    return ModelShard(
        config=config,
        plan=plan,
        vocab_start=start,
        vocab_stop=stop,
        lm_head=None if config.tie_word_embeddings else LM_HEAD,
        final_norm=_whole(FINAL_NORM, (config.hidden_size,)),
        layers=tuple(layer(config, plan, i, fused) for i in range(config.num_hidden_layers)),
    )


def vocab_rows(checkpoint: Checkpoint, shard: ModelShard, name: str, dtype: str) -> np.ndarray:
    """This rank's block of a (vocab, hidden) matrix (the embedding or the LM head) as numpy
    ``dtype``; rows past the real vocabulary (the padding of the last block) are zero."""
    vocab, hidden = shard.config.vocab_size, shard.config.hidden_size
    start, stop = shard.vocab_start, shard.vocab_stop
    real_stop = min(stop, vocab)
    if real_stop > start:
        rows = checkpoint.read(_part(name, (vocab, hidden), 0, (start, real_stop)), dtype)
    else:
        checkpoint.check_shape(name, (vocab, hidden))
        rows = np.zeros((0, hidden), dtype)
    if rows.shape[0] < stop - start:
        rows = np.concatenate([rows, np.zeros((stop - start - rows.shape[0], hidden), rows.dtype)])
    return rows
