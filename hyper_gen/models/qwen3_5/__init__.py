"""Qwen3.5 (dense and MoE; the text part of the multimodal checkpoints), framework-neutral.

The family's description every port consumes: the config (``config``), the checkpoint names and
tensor-parallel slices (``shards``), and the collective traffic a TP rank moves (``tp_traffic``).
The kernels live per framework in ``hyper_gen.backends.<framework>.models.qwen3_5``.
"""

from __future__ import annotations

from hyper_gen.models.checkpoint import Checkpoint

from .config import ARCHITECTURES, Qwen3_5Config
from .shards import check_tp, describe

NAME = "qwen3_5"


def config_from_checkpoint(checkpoint: Checkpoint) -> Qwen3_5Config:
    """The checked config (``Qwen3_5Config.from_checkpoint``): config.json's fields, and config.json
    against the checkpoint's tensors and token ids, before any weight is read."""
    return Qwen3_5Config.from_checkpoint(checkpoint)


__all__ = ["ARCHITECTURES", "NAME", "Qwen3_5Config", "check_tp", "config_from_checkpoint", "describe"]
