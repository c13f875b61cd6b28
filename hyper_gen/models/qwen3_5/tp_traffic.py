"""Bytes a tensor-parallel Qwen3.5 rank moves through collectives per decode step, framework-free.

What one decode step (B rows, one new token each) runs, for the native models of both backends
under ``TPPlan(tp, rank)``:

- all-reduces, each of a (B, 1, hidden) tensor in the model dtype: 1 for the vocab-parallel
  embedding, then 2 per decoder layer (the mixer's row-parallel output: o_proj or out_proj; the
  MLP's / MoE's: down_proj, routed and shared experts summed before one all-reduce);
- one all-gather of the vocab-sharded last-position logits, (B, padded V / tp) per rank in the
  model dtype (generate() gathers before it casts to float32), padded V = ``TPPlan.padded_vocab``.

Ring algorithms, per rank (sent, and as much received):

    all_reduce_bytes = (1 + 2 * num_hidden_layers) * B * hidden * dtype_bytes * 2 * (tp - 1) / tp
    all_gather_bytes = B * padded_V * dtype_bytes * (tp - 1) / tp
    per step         = all_reduce_bytes + all_gather_bytes

(a ring all-reduce of N bytes is a reduce-scatter plus an all-gather, each moving (tp-1)/tp of N
per rank). Prefill moves the same with B * prompt length rows in the all-reduces. The one-off
input check before the first step (a 16-word all-gather) is not counted. MindSpore's float64
validation path replaces each all-reduce by an all-gather of tp copies (see its model), which
this does not model.
"""

from __future__ import annotations

from typing import Dict, Tuple

from hyper_gen.parallel.tp_plan import TPPlan


def decode_step_collectives(config, batch: int, tp: int, dtype_bytes: int) -> Dict[str, Tuple[int, int]]:
    """{"all_reduce": (calls, bytes of each call's tensor), "all_gather": (calls, bytes each rank
    contributes)} for one decode step; empty at tp 1. ``config``: a ``Qwen3_5Config``."""
    for name, value in (("batch", batch), ("tp", tp), ("dtype_bytes", dtype_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if tp == 1:
        return {}
    padded_vocab = TPPlan(tp).padded_vocab(config.vocab_size)
    return {
        "all_reduce": (1 + 2 * config.num_hidden_layers, batch * config.hidden_size * dtype_bytes),
        "all_gather": (1, batch * padded_vocab // tp * dtype_bytes),
    }


def collective_bytes_per_decode_step(config, batch: int, tp: int, dtype_bytes: int) -> float:
    """Bytes each rank sends (and receives) through collectives per decode step (module docstring)."""
    calls = decode_step_collectives(config, batch, tp, dtype_bytes)
    if not calls:
        return 0.0
    reduces, reduce_bytes = calls["all_reduce"]
    gathers, gather_bytes = calls["all_gather"]
    return reduces * reduce_bytes * 2 * (tp - 1) / tp + gathers * gather_bytes * (tp - 1)
