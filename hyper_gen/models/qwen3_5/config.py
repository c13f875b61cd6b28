"""The Qwen3.5 text config: the part of ``config.json`` both ports build the architecture from.

Parsed and checked once, so torch and MindSpore build the same model from it, and a bad config
fails with the field named before any weight is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Tuple

ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
LAYER_TYPES = ("linear_attention", "full_attention")
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Qwen3_5Config:
    """Qwen3.5 text-model settings (dense when ``num_experts == 0``, MoE otherwise)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: Tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # the first rotary_dim channels of each head are rotated (partial rotary)
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # dense MLP
    intermediate_size: int = 0
    # MoE (the router always renormalises its top-k weights, as transformers 5.23 does)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # positions the model was trained for (HF's default when the config omits it): generate()
    # refuses longer prompts and stops rows there
    max_position_embeddings: int = 32768

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, config: dict) -> "Qwen3_5Config":
        """Parse the text part of an HF config.json (``Checkpoint.config``)."""

        def field(name, kind=int, default=None):
            value = config.get(name, default)
            if value is None:
                raise ValueError(f"config.json is missing field {name!r}")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"config.json field {name!r} must be an int, got {value!r}")
            if kind is int and value <= 0:
                raise ValueError(f"config.json field {name!r} must be > 0, got {value!r}")
            return kind(value)

        def number(name, value, default):
            value = default if value is None else value  # null: the default, as for a missing field
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"config.json field {name!r} must be a finite number, got {value!r}")
            return float(value)

        hidden_act = config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json field 'hidden_act' must be 'silu', got {hidden_act!r}")
        if config.get("attention_bias", False):
            raise ValueError("config.json field 'attention_bias' must be false (Qwen3.5 has no attention bias)")

        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"config.json field 'rope_parameters' must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json rope_parameters 'rope_type' must be 'default', got {rope_type!r}")
        rope_theta = number("rope_theta", rope.get("rope_theta", config.get("rope_theta")), 10000.0)
        # transformers defaults partial_rotary_factor to 0.25 for Qwen3.5 when the config omits it
        partial = number(
            "partial_rotary_factor", rope.get("partial_rotary_factor", config.get("partial_rotary_factor")), 0.25
        )

        hidden_size = field("hidden_size")
        num_heads = field("num_attention_heads")
        num_kv_heads = field("num_key_value_heads")
        head_dim = field("head_dim", default=hidden_size // num_heads)
        rotary_dim = int(head_dim * partial)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(
                f"config.json partial_rotary_factor {partial} gives {rotary_dim} rotary dims of head_dim "
                f"{head_dim}: must be even and in (0, head_dim]"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads})"
            )

        num_layers = field("num_hidden_layers")
        layer_types = config.get("layer_types")
        if layer_types is None:
            interval = field("full_attention_interval", default=4)
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
            ]
        if not isinstance(layer_types, (list, tuple)):
            raise ValueError(f"config.json field 'layer_types' must be a list, got {layer_types!r}")
        layer_types = tuple(layer_types)
        if len(layer_types) != num_layers:
            raise ValueError(
                f"config.json layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}"
            )
        for kind in layer_types:
            if kind not in LAYER_TYPES:
                raise ValueError(f"config.json layer_types entry {kind!r} is not one of {LAYER_TYPES}")

        linear_k_heads = field("linear_num_key_heads")
        linear_v_heads = field("linear_num_value_heads")
        if linear_v_heads % linear_k_heads:
            raise ValueError(
                f"config.json linear_num_value_heads ({linear_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({linear_k_heads})"
            )

        moe = config.get("num_experts") is not None
        if moe and not 0 < field("num_experts_per_tok") <= field("num_experts"):
            raise ValueError(
                f"config.json num_experts_per_tok ({config['num_experts_per_tok']}) must be <= num_experts "
                f"({config['num_experts']})"
            )
        return cls(
            vocab_size=field("vocab_size"),
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            layer_types=layer_types,
            rms_norm_eps=number("rms_norm_eps", config.get("rms_norm_eps"), 1e-6),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=rope_theta,
            linear_num_key_heads=linear_k_heads,
            linear_num_value_heads=linear_v_heads,
            linear_key_head_dim=field("linear_key_head_dim"),
            linear_value_head_dim=field("linear_value_head_dim"),
            linear_conv_kernel_dim=field("linear_conv_kernel_dim", default=4),
            intermediate_size=0 if moe else field("intermediate_size"),
            num_experts=field("num_experts") if moe else 0,
            num_experts_per_tok=field("num_experts_per_tok") if moe else 0,
            moe_intermediate_size=field("moe_intermediate_size") if moe else 0,
            shared_expert_intermediate_size=field("shared_expert_intermediate_size") if moe else 0,
            max_position_embeddings=field("max_position_embeddings", default=32768),
        )

    @classmethod
    def from_checkpoint(cls, checkpoint) -> "Qwen3_5Config":
        """The config of a ``hyper_gen.models.checkpoint.Checkpoint``, checked against what the
        checkpoint holds (``check_checkpoint``), before any weight is read; every error names the
        checkpoint folder."""
        try:
            config = cls.from_dict(checkpoint.config)
        except ValueError as error:
            raise ValueError(f"checkpoint {checkpoint.path!r}: {error}") from None
        check_checkpoint(config, checkpoint)
        return config


def check_checkpoint(config: Qwen3_5Config, checkpoint) -> None:
    """What config.json says against the checkpoint's files: no tensors for layers past
    ``num_hidden_layers`` (they would be ignored silently), and eos / pad ids in the vocabulary."""
    layers = {}  # layer index -> one of its tensors
    for name in checkpoint.names():
        match = _LAYER_TENSOR.match(name)
        if match:
            layers.setdefault(int(match.group(1)), name)
    last = max(layers, default=-1)
    if last >= config.num_hidden_layers:
        raise ValueError(
            f"checkpoint {checkpoint.path!r}: {checkpoint.file_of(layers[last])} has tensors for layer {last} "
            f"(e.g. {layers[last]!r}) but {checkpoint.config_file} has num_hidden_layers {config.num_hidden_layers}: "
            "the config does not describe these weights"
        )
    checkpoint.check_token_ids(config.vocab_size)
