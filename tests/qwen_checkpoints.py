"""Tiny random Qwen3.5 checkpoints written with HF ``save_pretrained``, for parity tests.

Shared by the torch and MindSpore model tests::

    from tests.qwen_checkpoints import make_checkpoint, load_hf
    path = make_checkpoint(tmp_path, kind="moe", dtype="float32", fused_experts=True)
    hf = load_hf(path, "float64")          # the HF reference model for that checkpoint

Kinds: ``dense`` (Qwen3_5ForCausalLM), ``moe`` (Qwen3_5MoeForCausalLM), ``multimodal``
(Qwen3_5ForConditionalGeneration, a tiny vision tower included), ``multimodal_moe``
(Qwen3_5MoeForConditionalGeneration).

Every weight is re-drawn at a scale that gives O(1) activations and logits (HF's 0.02 init gives
logits so small that a 1e-4 tolerance would prove nothing), and the zero-centred norm weights
are made non-zero so ``x * (1 + w)`` is really exercised. ``A_log`` keeps HF's init.

transformers 5.23 ``save_pretrained`` writes MoE experts per expert
(``mlp.experts.N.{gate,up,down}_proj.weight``); ``fused_experts=True`` rewrites the file in the
fused layout HF holds in memory (``mlp.experts.gate_up_proj`` (E, 2I, H), gate rows first, and
``mlp.experts.down_proj`` (E, H, I)).
"""

from __future__ import annotations

import json
import math
import os

# The text config every kind shares: 4 layers (Gated DeltaNet, attention, Gated DeltaNet,
# attention); GQA in both attention kinds; key and value head dims differ so mix-ups show.
TINY_TEXT_CONFIG = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # partial_rotary_factor 0.25 -> 4 rotary dims
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    eos_token_id=[5, 7],
    pad_token_id=0,
)
# checkpoint variants the model parity suites of both backends run: name -> (kind, make_checkpoint keywords)
VARIANTS = {
    "dense": ("dense", {}),
    "dense_tied": ("dense", {"tie_word_embeddings": True}),
    "moe": ("moe", {}),
    "moe_fused": ("moe", {"fused_experts": True}),
    "multimodal_tied": ("multimodal", {"tie_word_embeddings": True}),
    "multimodal_moe": ("multimodal_moe", {}),
}
TINY_MOE_CONFIG = dict(
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
)
TINY_VISION_CONFIG = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=16,
    num_heads=2,
    patch_size=2,
    temporal_patch_size=1,
    spatial_merge_size=1,
    num_position_embeddings=16,
    out_hidden_size=32,
)

KINDS = ("dense", "moe", "multimodal", "multimodal_moe")
_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _hf_config(kind: str, tie_word_embeddings: bool, text_overrides=None):
    import transformers as tf

    text = dict(TINY_TEXT_CONFIG)
    if kind in ("moe", "multimodal_moe"):
        text.pop("intermediate_size")
        text.update(TINY_MOE_CONFIG)
    text.update(text_overrides or {})
    if kind == "dense":
        return tf.Qwen3_5TextConfig(**text, tie_word_embeddings=tie_word_embeddings), tf.Qwen3_5ForCausalLM
    if kind == "moe":
        return tf.Qwen3_5MoeTextConfig(**text, tie_word_embeddings=tie_word_embeddings), tf.Qwen3_5MoeForCausalLM
    if kind == "multimodal":
        config = tf.Qwen3_5Config(
            text_config=text, vision_config=dict(TINY_VISION_CONFIG), tie_word_embeddings=tie_word_embeddings
        )
        return config, tf.Qwen3_5ForConditionalGeneration
    config = tf.Qwen3_5MoeConfig(
        text_config=text, vision_config=dict(TINY_VISION_CONFIG), tie_word_embeddings=tie_word_embeddings
    )
    return config, tf.Qwen3_5MoeForConditionalGeneration


def _randomise(model, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim >= 2:  # weights: unit-variance outputs for unit-variance inputs
                param.copy_(noise / math.sqrt(param.shape[-1]))
            else:  # norm weights (zero-centred or 1-centred), dt_bias, biases
                param.add_(0.1 * noise)


def make_checkpoint(
    tmp_path,
    kind: str = "dense",
    dtype: str = "float32",
    fused_experts: bool = False,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    text_overrides: dict = None,
) -> str:
    """Write a tiny random HF checkpoint under ``tmp_path`` and return its folder.

    ``text_overrides``: text-config fields to change (e.g. ``{"num_key_value_heads": 1}``).
    The folder name encodes the arguments, so a second call with the same arguments reuses it.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if fused_experts and "moe" not in kind:
        raise ValueError(f"fused_experts=True needs an MoE kind, got kind={kind!r}")
    name = f"{kind}-{dtype}{'-fused' if fused_experts else ''}{'-tied' if tie_word_embeddings else ''}-s{seed}"
    if text_overrides:
        name += "-" + "-".join(f"{key}={text_overrides[key]}" for key in sorted(text_overrides)).replace(" ", "")
    path = os.path.join(os.fspath(tmp_path), name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path

    import torch

    config, cls = _hf_config(kind, tie_word_embeddings, text_overrides)
    torch.manual_seed(seed)
    model = cls(config).eval()
    _randomise(model, seed)
    if tie_word_embeddings:
        model.tie_weights()
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    if fused_experts:
        _fuse_experts(path)
    return path


def _fuse_experts(path: str) -> None:
    """Rewrite model.safetensors with per-expert weights stacked into the fused layout."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    pattern = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    grouped: dict = {}
    fused = {}
    for name, tensor in tensors.items():
        match = pattern.match(name)
        if match is None:
            fused[name] = tensor
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        grouped.setdefault(prefix, {}).setdefault(proj, {})[expert] = tensor
    for prefix, projs in grouped.items():
        experts = sorted(projs["gate_proj"])
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], 0) for e in experts]
        ).contiguous()
        fused[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in experts]).contiguous()
    save_file(fused, file, metadata={"format": "pt"})


def load_hf(path: str, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """The HF transformers model of a checkpoint made here, in eval mode.

    MoE experts use HF's "eager" implementation (a loop over the experts hit): the default
    grouped_mm kernel has no float64 version on CPU."""
    import torch
    import transformers as tf

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        architecture = json.load(f)["architectures"][0]
    cls = getattr(tf, architecture)
    extra = {"experts_implementation": "eager"} if "Moe" in architecture else {}
    return cls.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation, **extra
    ).eval()
