"""The building blocks of the torch model ports that hold no weights of a model family: HF's
zero-centred and gated RMSNorms and rotary tables (the tensor-parallel sum and token packing are
the neutral ``hyper_gen.parallel.rank_sum`` / ``hyper_gen.token_packing``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyper_gen.backends.torch import invariant_ops


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What HF's float32 steps run in: float32 as HF's, float64 in a float64 model (no float32 islands)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------- norms


class ZeroCentredRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)``, computed in ``compute_dtype`` and cast back (HF Qwen3_5RMSNorm).

    ``scale`` = ``1 + w`` in that dtype is precomputed at load (a buffer, so ``parameters()`` keeps
    the model dtype); it is bitwise what HF computes each call. A ``trainable`` norm (batch-invariant
    mode) holds HF's ``weight`` as a parameter instead and computes ``1 + w`` each call (the same bits)."""

    def __init__(self, dim: int, eps: float, trainable: bool = False):
        super().__init__()
        self.eps = eps
        self.trainable = trainable
        if trainable:
            self.weight = nn.Parameter(torch.empty(dim))
        else:
            self.register_buffer("scale", torch.empty(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trainable:
            wide = compute_dtype(x.dtype)
            scale = 1.0 + self.weight.to(wide)
        else:
            wide, scale = self.scale.dtype, self.scale
        h = x.to(wide)
        if self.trainable:  # batch-invariant mode's: a fixed-order sum
            h = invariant_ops.rms_normalise(h, self.eps)
        else:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * scale).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, invariant=None):
    """Gated DeltaNet output norm: ``w * x / rms(x) * silu(gate)`` (HF Qwen3_5RMSNormGated);
    ``invariant``: the ``invariant_ops`` module, whose sum and silu batch-invariant mode runs."""
    dtype, wide = x.dtype, compute_dtype(x.dtype)
    h = x.to(wide)
    if invariant is not None:
        h = invariant.rms_normalise(h, eps)
    else:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    silu = F.silu if invariant is None else invariant.silu
    h = weight * h.to(dtype)
    h = h * silu(gate.to(wide))
    return h.to(dtype)


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------------- rotary


def rotary_inverse_frequencies(rotary_dim: int, theta: float, dtype=torch.float32) -> torch.Tensor:
    """In ``dtype`` (the model's ``compute_dtype``: float32 exactly as HF computes them)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=dtype) / rotary_dim))


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """(B, S, rotary_dim) cos and sin in ``dtype`` for integer positions (B, S)."""
    freqs = position_ids[..., None].to(inv_freq.dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of x (B, H, S, D); cos/sin are (B, 1, S, rot)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat(((x_rot * cos) + (rotated * sin), x_pass), dim=-1)


# ------------------------------------------------------------------------------------ attention


def attention_lse(query, key, value, mask, scale: float):
    """Softmax attention of ``query`` (B, H, L, D) over ``key`` / ``value`` (B, H, T, D) with an
    additive ``mask`` (broadcast to (B, H, L, T)): the output (B, H, L, D) in the query's dtype
    and the log-sum-exp of the scores (B, H, L) in ``compute_dtype``, what merging attention over
    pieces of the keys needs. On CPU, torch's flash kernel (the one ``scaled_dot_product_attention``
    runs there) returns both; elsewhere the same math in plain ops."""
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=mask, scale=scale
        )[:2]
        return out, lse.to(compute_dtype(query.dtype))
    wide = compute_dtype(query.dtype)
    scores = (query.to(wide) @ key.to(wide).transpose(-1, -2)) * scale + mask.to(wide)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ value.to(wide)
    return out.to(query.dtype), lse
