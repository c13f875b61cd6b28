"""``load_model``: an HF Qwen3.5 checkpoint folder -> a native torch or MindSpore model.

Backend-neutral: neither torch nor mindspore is imported here at module import time; the chosen
backend's model module (``hyper_gen.backends.<framework>.models.qwen3_5``) is imported inside
:func:`load_model`, and every backend exposes ``load(checkpoint, dtype, ..., plan=None, group=None)``.
With ``tp > 1`` the process group is joined here and each rank loads only its shard
(``hyper_gen.tensor_parallel.TPPlan``).

:class:`TextConfig` is the part of ``config.json`` the model needs, parsed and checked once so
both backends build the same architecture from it (and a bad config fails with the field named).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional, Tuple

from hyper_gen.checkpoint import Checkpoint
from hyper_gen.tensor_parallel import TPPlan

SUPPORTED_ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
DTYPES = ("float32", "float64", "float16", "bfloat16")
BACKENDS = {"torch": "torch_npu", "mindspore": "mindspore"}  # backend name -> adapter package
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class TextConfig:
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, config: dict) -> "TextConfig":
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

        hidden_act = config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json field 'hidden_act' must be 'silu', got {hidden_act!r}")
        if config.get("attention_bias", False):
            raise ValueError("config.json field 'attention_bias' must be false (Qwen3.5 has no attention bias)")

        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json rope_parameters 'rope_type' must be 'default', got {rope_type!r}")
        rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        # transformers defaults partial_rotary_factor to 0.25 for Qwen3.5 when the config omits it
        partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))

        hidden_size = field("hidden_size")
        num_heads = field("num_attention_heads")
        num_kv_heads = field("num_key_value_heads")
        head_dim = field("head_dim", default=hidden_size // num_heads)
        rotary_dim = int(head_dim * partial)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(
                f"config.json partial_rotary_factor {partial} gives {rotary_dim} rotary dims of head_dim "
                f"{head_dim}: must be even and in (0, head_dim]")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads})")

        num_layers = field("num_hidden_layers")
        layer_types = config.get("layer_types")
        if layer_types is None:
            interval = field("full_attention_interval", default=4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(num_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != num_layers:
            raise ValueError(
                f"config.json layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
        for kind in layer_types:
            if kind not in LAYER_TYPES:
                raise ValueError(f"config.json layer_types entry {kind!r} is not one of {LAYER_TYPES}")

        linear_k_heads = field("linear_num_key_heads")
        linear_v_heads = field("linear_num_value_heads")
        if linear_v_heads % linear_k_heads:
            raise ValueError(
                f"config.json linear_num_value_heads ({linear_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({linear_k_heads})")

        moe = config.get("num_experts") is not None
        if moe and not 0 < field("num_experts_per_tok") <= field("num_experts"):
            raise ValueError(
                f"config.json num_experts_per_tok ({config['num_experts_per_tok']}) must be <= num_experts "
                f"({config['num_experts']})")
        return cls(
            vocab_size=field("vocab_size"),
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            layer_types=layer_types,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
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
        )


def generation_defaults(checkpoint: Checkpoint) -> dict:
    """eos/pad/bos token ids from generation_config.json, falling back to config.json."""
    defaults = {}
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = checkpoint.generation_config.get(name, checkpoint.config.get(name))
        if value is not None:
            defaults[name] = value
    return defaults


def load_model(path, backend: str = "torch", dtype: str = "float32", device: Optional[str] = None, tp: int = 1):
    """Load a Qwen3.5 checkpoint folder as a native ``backend`` model in ``dtype``.

    ``device``: a torch device string for ``backend="torch"`` (default CPU; with ``tp > 1`` the
    rank's own accelerator, ``npu:<LOCAL_RANK>`` / ``cuda:<LOCAL_RANK>``, where one exists); for
    ``backend="mindspore"`` the MindSpore device target ("CPU", "Ascend"), which must be the one
    already selected with ``mindspore.set_device`` (default: whatever is selected).
    The model carries ``generation_defaults`` (eos/pad/bos ids from generation_config.json).

    ``tp``: tensor-parallel ranks. With ``tp > 1`` every process of a ``torchrun`` (torch) or
    ``msrun`` (MindSpore) job of exactly ``tp`` ranks calls this; the job's process group is
    joined if not yet, the config is checked against ``TPPlan(tp, rank)`` before any weight is
    read, and each rank reads only its slices. The tp ranks are the whole job (world == tp).
    Pass the model to ``hyper_gen.generate`` on every rank with the same inputs.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {backend!r}")
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str, one of {DTYPES}, got {type(dtype).__name__} {dtype!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if device is not None and not isinstance(device, str):
        raise TypeError(f"device must be a str or None, got {type(device).__name__} {device!r}")
    if backend == "torch" and tp > 1 and device is None:
        from hyper_gen.backends.torch_npu import rank_device

        device = rank_device()  # the collective library (HCCL/NCCL/gloo) follows the same choice
    device = _check_device_dtype(backend, dtype, device)

    checkpoint = Checkpoint(path)
    if checkpoint.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"checkpoint {checkpoint.path!r} has architecture {checkpoint.architecture or None!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    module = importlib.import_module(f"hyper_gen.backends.{BACKENDS[backend]}.models.qwen3_5")
    kwargs = {"device": device} if backend == "torch" else {}  # MindSpore: the selected device target
    if tp > 1:
        kwargs.update(plan=_join_tp_job(backend, tp, TextConfig.from_dict(checkpoint.config)), group=None)
    model = module.load(checkpoint, dtype, **kwargs)
    model.generation_defaults = generation_defaults(checkpoint)
    return model


def _join_tp_job(backend: str, tp: int, config: TextConfig) -> TPPlan:
    """This rank's ``TPPlan`` in the launcher's job of ``tp`` ranks, the config checked against it.

    The divisibility checks do not depend on the rank, so a tp that does not divide the heads
    fails (on every rank alike) before the process group is touched."""
    TPPlan(tp, 0).check(config)
    from hyper_gen.distributed import host_ops, init_distributed

    launcher = "torchrun --nproc_per_node" if backend == "torch" else "msrun --worker_num"
    if not init_distributed(backend):
        raise ValueError(
            f"tp={tp} needs {tp} processes launched together ({launcher} {tp} ...), but this is a single "
            "process with no process group; use tp=1 here")
    ops = host_ops(backend)
    world, rank = ops.world_size(), ops.rank()
    if world != tp:
        raise ValueError(f"tp={tp} but the job has {world} ranks: tensor parallelism spans the whole job, "
                         f"launch it with {launcher} {tp}")
    plan = TPPlan(tp, rank)
    plan.check(config)
    return plan


def _check_device_dtype(backend: str, dtype: str, device: Optional[str]) -> Optional[str]:
    """Reject dtypes the device cannot compute in; returns the device to load onto."""
    if backend == "torch":
        kind = (device or "cpu").split(":")[0].lower()
        if dtype == "float64" and kind in ("mps", "npu"):
            raise ValueError(f"dtype 'float64' is not supported on torch device {device!r}")
        return device
    import mindspore

    target = mindspore.get_context("device_target")
    if device is not None and device.lower() != str(target).lower():
        raise ValueError(
            f"device {device!r} is not the selected MindSpore device target {target!r}: call "
            f"mindspore.set_device({device!r}) before load_model")
    if dtype == "bfloat16" and str(target).upper() == "CPU":
        raise ValueError("dtype 'bfloat16' is not supported by MindSpore on CPU (storage only); "
                         "use float32, float16 or float64")
    return target
