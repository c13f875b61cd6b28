"""SGLang's ``GET /server_info`` and ``GET /model_info`` (also served as ``/get_server_info`` and
``/get_model_info``, SGLang's older names), which the routers read when a worker registers.

sglang-router labels the worker with ``model_path`` / ``served_model_name`` / ``tp_size`` /
``dp_size`` from ``/server_info`` and ``model_type`` / ``architectures`` from ``/model_info`` (and
loads its own tokenizer from ``model_path`` when that is a local folder); vllm-router's
``kv_aware`` policy reads ``/get_server_info``. The numbers are the engine's, with SGLang's names:
``max_total_num_tokens`` is the KV cache pool in tokens (blocks x block size), ``max_running_requests``
the rows decoded together, ``context_length`` the positions a request may use.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from hyper_gen import __version__

from .sglang import version_text


def _checkpoint_config(path: Optional[str]) -> dict:
    """The checkpoint's config.json (empty when there is none to read)."""
    if not path:
        return {}
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _kv_tokens(stats: dict) -> Optional[int]:
    blocks, size = stats.get("blocks_total"), stats.get("block_size")
    return int(blocks) * int(size) if blocks is not None and size is not None else None


def server_info(state) -> dict:
    engine = state.engine
    config = getattr(engine, "config", None)
    stats = engine.stats()
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "served_model_name": state.model_name,
        "is_generation": True,
        "tp_size": state.tp_size,
        "dp_size": 1,
        "context_length": state.max_model_len,
        "max_running_requests": getattr(config, "max_num_seqs", None),
        "max_total_num_tokens": _kv_tokens(stats),
        "max_prefill_tokens": getattr(config, "max_num_batched_tokens", None),
        "chunked_prefill_size": getattr(config, "max_num_batched_tokens", None),
        "page_size": stats.get("block_size"),
        "disable_radix_cache": not getattr(config, "enable_prefix_caching", True),
        "backend": state.backend,
        "weight_version": version_text(getattr(engine, "weight_version", None)),
        "version": __version__,
    }


def model_info(state) -> dict:
    config = _checkpoint_config(state.model_path)
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": version_text(getattr(state.engine, "weight_version", None)),
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "max_total_num_tokens": _kv_tokens(state.engine.stats()),
    }
