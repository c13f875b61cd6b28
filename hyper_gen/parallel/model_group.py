"""What generate() needs to know about a model split across ranks.

A model declares it with two attributes (the native Qwen3.5 ports set them under ``tp > 1``;
a user's own tensor-parallel model sets them the same way):

- ``parallel_group``: the process group its ranks share (``None`` or absent: not distributed);
- ``vocab_parallel``: True when each rank's logits hold only its slice of the vocabulary (equal
  blocks in rank order; ``vocab_size``, if set, trims the padding of the last block).

Before the first step every rank's inputs and config are compared with one small all-gather, so
a rank handed different prompts raises the same ``ValueError`` everywhere instead of hanging or
silently diverging.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


def parallel_group(ops, model):
    """(group, world size) when ``model`` is split across more than one rank, else (None, 1)."""
    if not hasattr(model, "parallel_group"):
        return None, 1
    group = model.parallel_group
    size = ops.world_size(group)
    return (group, size) if size > 1 else (None, 1)


def _fingerprint(prompt, config) -> np.ndarray:
    digest = hashlib.sha256()
    digest.update(prompt.ids.tobytes())
    digest.update(prompt.mask.tobytes())
    digest.update(repr(prompt.ids.shape).encode())
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name in ("logits_processor", "stopping_criteria"):
            value = None if value is None else len(value)
        digest.update(f"{field.name}={value!r};".encode())
    words = np.frombuffer(digest.digest()[:16], dtype=np.uint16)
    return words.astype(np.float32)[None, :]  # 16-bit words: exact in float32, which every collective carries


def check_consistent_inputs(ops, model, prompt, config) -> None:
    group, size = parallel_group(ops, model)
    if size == 1:
        return
    mine = _fingerprint(prompt, config)
    everyone = ops.to_numpy(ops.all_gather(ops.asarray(mine, "float32"), axis=0, group=group))
    differing = [r for r in range(everyone.shape[0]) if not np.array_equal(everyone[r], everyone[0])]
    if differing:
        raise ValueError(
            f"generate() was called with different input_ids/attention_mask/config on rank(s) {differing} "
            f"than on rank 0 of the {size}-rank model group; every rank must get the same inputs"
        )


def gather_vocab_logits(ops, model, logits):
    """Full-vocabulary logits (B, V) from a vocab-sharded model's local slice; else unchanged."""
    if not getattr(model, "vocab_parallel", False):
        return logits
    group, size = parallel_group(ops, model)
    if size == 1:
        return logits
    gathered = ops.all_gather(logits, axis=-1, group=group)
    vocab_size = getattr(model, "vocab_size", None)  # the shards may be padded to a multiple of tp
    return gathered[..., :vocab_size] if vocab_size and gathered.shape[-1] > vocab_size else gathered
