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


def describe_choices() -> str:
    """The product each float32 CPU weight shape timed in this process runs through, for the
    benchmarks' output: ``(in, out) oneDNN`` (a packed copy), ``blocked W`` (``W``-column blocks)
    or ``MKL`` (the whole product; MKL's packed GEMM for 8-64-row decode steps)."""
    shapes = sorted(set(onednn_gemm._CHOSEN) | set(blocked_gemm._CHOSEN))
    parts = []
    for shape in shapes:
        if onednn_gemm._CHOSEN.get(shape):
            kind = "oneDNN"
        elif blocked_gemm._CHOSEN.get(shape):
            kind = f"blocked {blocked_gemm._CHOSEN[shape]}"
        else:
            kind = "MKL"
        parts.append(f"{shape[0]}x{shape[1]} {kind}")
    return ", ".join(parts) or "none timed (every weight below the size the choice is made for)"
