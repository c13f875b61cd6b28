"""``project(x, w)``: every projection of the torch models, ``x @ w`` for an (in, out) weight,
through the fastest kernel this host and the weight's stored layout allow: oneDNN's packed
weights (``onednn_gemm``, chosen per shape at load), the blocked product (``blocked_gemm``, chosen
per shape at load), the packed batched-decode GEMM (``packed_gemm``) or else the plain product."""

from __future__ import annotations

import torch

from hyper_gen.backends.torch import blocked_gemm, onednn_gemm, packed_gemm


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = onednn_gemm.project(x, w)
    if out is None:
        out = blocked_gemm.project(x, w)
    return out if out is not None else packed_gemm.project(x, w)


def check_switches() -> None:
    """Each projection path's environment switch read once, at load: a bad value is a ValueError
    naming it before any work (``hyper_gen.switches``)."""
    blocked_gemm.enabled()
    onednn_gemm._budget_bytes()
    packed_gemm._budget_bytes()
