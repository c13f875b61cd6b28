"""Model families and loading: HF checkpoint folders -> native models on any backend.

``checkpoint`` reads HF folders (config, generation defaults, safetensors slices); each family
package (``qwen3_5/``) describes its architecture framework-free (config, checkpoint names,
tensor-parallel slices); ``loading.load_model`` picks the family by the checkpoint's architecture
and the kernels by backend (the adapter's ``models.<family>``).

A new family (Qwen3, Llama) is a package here with ``NAME``, ``ARCHITECTURES``,
``config_from_checkpoint`` and ``check_tp``, one ``models/<family>.py`` per backend, and its
architectures in ``FAMILIES``.
"""

from __future__ import annotations

from .qwen3_5.config import ARCHITECTURES as _QWEN3_5

# HF architecture name -> family package under hyper_gen.models
FAMILIES = {architecture: "qwen3_5" for architecture in _QWEN3_5}

__all__ = ["FAMILIES"]
