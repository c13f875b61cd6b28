"""``project(x, w)``: every projection of the torch models, ``x @ w`` for an (in, out) weight,
through the fastest kernel this host and the weight's stored layout allow: the blocked product
(``blocked_gemm``, chosen per shape at load) or else the packed batched-decode GEMM
(``packed_gemm``) or else the plain product."""

from __future__ import annotations

import torch

from hyper_gen.backends.torch import blocked_gemm, packed_gemm


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = blocked_gemm.project(x, w)
    return out if out is not None else packed_gemm.project(x, w)
