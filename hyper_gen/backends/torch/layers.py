"""The building blocks of the torch model ports that hold no weights of a model family: HF's
zero-centred and gated RMSNorms, rotary tables, the tensor-parallel sum and the
packing of a left-padded prefill's real tokens."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------- norms


class ZeroCentredRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)``, computed in float32 and cast back (HF Qwen3_5RMSNorm).

    ``scale`` = ``1 + w`` in float32 is precomputed at load (a buffer, so ``parameters()`` keeps
    the model dtype); it is bitwise what HF computes each call."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("scale", torch.empty(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.scale).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: ``w * x / rms(x) * silu(gate)`` (HF Qwen3_5RMSNormGated)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(dtype)


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------------- rotary


def rotary_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """float32, exactly as HF computes them (the angles stay float32 for every model dtype)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """(B, S, rotary_dim) cos and sin in ``dtype`` for integer positions (B, S)."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of x (B, H, S, D); cos/sin are (B, 1, S, rot)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat(((x_rot * cos) + (rotated * sin), x_pass), dim=-1)


class RankSum:
    """Sums a row-parallel partial output over the tensor-parallel group in place (one
    all-reduce); the identity at tp 1. ``group`` None is the world group."""

    def __init__(self, tp: int, group=None):
        self.tp = tp
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.group)
        return x


class TokenPacking:
    """The real tokens of a left-padded prefill, packed: the row-wise work of every layer (norms,
    projections, MLP / experts, residual adds) runs on the (N, H) real rows only, and just the
    sequence mixers' cores (rotary + attention, conv + delta rule) see the padded (B, S, C) layout,
    with zeros at the padding: exactly what HF's masked Gated DeltaNet input projects to, and keys
    the attention mask hides. A batch of mixed-length prompts then costs its tokens, not B x S."""

    def __init__(self, prompt_mask: torch.Tensor):
        self.batch, self.seq = prompt_mask.shape
        self.index = prompt_mask.reshape(-1).nonzero().squeeze(1)
        self.leading_padding = [self.seq - int(n) for n in prompt_mask.sum(dim=1).tolist()]  # per row

    @classmethod
    def of(cls, prompt_mask: Optional[torch.Tensor]) -> Optional["TokenPacking"]:
        """None when there is no padding to skip."""
        if prompt_mask is None or prompt_mask.shape[1] == 1:
            return None
        packing = cls(prompt_mask)
        return packing if packing.index.numel() < packing.batch * packing.seq else None

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, C) -> (N, C): the real positions' rows, in order."""
        return x.reshape(-1, x.shape[-1]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) -> (B, S, C), zeros at the padding."""
        out = x.new_zeros(self.batch * self.seq, x.shape[-1])
        return out.index_copy_(0, self.index, x).view(self.batch, self.seq, -1)
