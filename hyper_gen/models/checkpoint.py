"""Read HF checkpoint folders (config.json + safetensors) into numpy, framework-free.

Both backends load weights through this module, so a missing file, a missing tensor or a
misshaped one gets the same clear error everywhere. ``get_slice`` reads only a slice of a tensor
from disk (safetensors is memory-mapped), which is what lets a tensor-parallel rank avoid
materialising the full weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

# text weights of the multimodal checkpoints live under this prefix; we expose them as "model."
_MULTIMODAL_TEXT_PREFIX = "model.language_model."
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.")


@dataclass(frozen=True)
class Piece:
    """What a model reads of one checkpoint tensor: ``ranges`` along ``axis`` (concatenated in
    order), or the whole tensor when ``ranges`` is None. ``shape`` is the tensor's full shape in
    the checkpoint, checked on every read, so a misshaped tensor fails with its name whatever
    part of it a rank reads."""

    name: str
    shape: Tuple[int, ...]
    axis: int = 0
    ranges: Optional[Tuple[Tuple[int, int], ...]] = None


def _bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32: bf16 is the top half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


class Checkpoint:
    """An HF checkpoint folder: its config, generation defaults and tensors by (normalised) name."""

    def __init__(self, path: str):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"model path must be a str or PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"model path {path!r} is not a directory (expected an HF checkpoint folder)")
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise ValueError(f"model path {path!r} has no config.json: not an HF checkpoint folder")
        with open(config_file, encoding="utf-8") as f:
            self.full_config: dict = json.load(f)
        self.path = path
        architectures = self.full_config.get("architectures") or []
        self.architecture: str = architectures[0] if architectures else ""
        # multimodal checkpoints keep the language model's settings under text_config
        text = self.full_config.get("text_config")
        self.config: dict = dict(text) if isinstance(text, dict) else dict(self.full_config)
        # a multimodal model ties its LM head by the top-level flag (HF reads it from the
        # top-level config); text_config's own flag is only a default there
        if "tie_word_embeddings" in self.full_config:
            self.config["tie_word_embeddings"] = self.full_config["tie_word_embeddings"]
        self.config.setdefault("tie_word_embeddings", False)
        self.generation_config: dict = {}
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file, encoding="utf-8") as f:
                self.generation_config = json.load(f)
        self._files = self._index_tensors()
        self._open: Dict[str, object] = {}
        self._headers: Dict[str, tuple] = {}  # shard file -> (data start, parsed header), bf16 reads

    def _index_tensors(self) -> Dict[str, str]:
        """normalised tensor name -> (file, stored name)."""
        index_file = os.path.join(self.path, "model.safetensors.index.json")
        single_file = os.path.join(self.path, "model.safetensors")
        stored: Dict[str, str] = {}
        if os.path.isfile(index_file):
            with open(index_file, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
            for name, fname in weight_map.items():
                full = os.path.join(self.path, fname)
                if not os.path.isfile(full):
                    raise ValueError(f"checkpoint {self.path!r}: shard {fname!r} named in the index is missing")
                stored[name] = full
        elif os.path.isfile(single_file):
            from safetensors import safe_open

            with safe_open(single_file, framework="numpy") as f:
                for name in f.keys():
                    stored[name] = single_file
        else:
            raise ValueError(f"checkpoint {self.path!r} has neither model.safetensors nor model.safetensors.index.json")
        files: Dict[str, tuple] = {}
        for name, fname in stored.items():
            if name.startswith(_SKIPPED_PREFIXES):
                continue
            normalised = (
                "model." + name[len(_MULTIMODAL_TEXT_PREFIX) :] if name.startswith(_MULTIMODAL_TEXT_PREFIX) else name
            )
            files[normalised] = (fname, name)
        return files

    def names(self) -> List[str]:
        return sorted(self._files)

    def has(self, name: str) -> bool:
        return name in self._files

    def _handle(self, name: str):
        if name not in self._files:
            raise ValueError(f"checkpoint {self.path!r} is missing tensor {name!r}")
        fname, stored = self._files[name]
        if fname not in self._open:
            from safetensors import safe_open

            self._open[fname] = safe_open(fname, framework="numpy")
        return self._open[fname], stored

    def shape(self, name: str) -> tuple:
        handle, stored = self._handle(name)
        return tuple(handle.get_slice(stored).get_shape())

    def check_shape(self, name: str, shape: Sequence[int]) -> None:
        """A ValueError naming the tensor when it is missing or not of ``shape``."""
        found = self.shape(name)
        if found != tuple(shape):
            raise ValueError(f"checkpoint {self.path!r}: tensor {name!r} has shape {found}, expected {tuple(shape)}")

    def read(self, piece: Piece, dtype: str = "float32") -> np.ndarray:
        """The part of a tensor ``piece`` names, as numpy ``dtype``, its full shape checked first."""
        self.check_shape(piece.name, piece.shape)
        if piece.ranges is None:
            return self._read(piece.name, None, dtype)
        parts = [self.get_slice(piece.name, piece.axis, start, stop, dtype) for start, stop in piece.ranges]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=piece.axis)

    def get(self, name: str, dtype: str = "float32", shape: Optional[Sequence[int]] = None) -> np.ndarray:
        """The whole tensor as numpy ``dtype``; ``shape`` (if given) is checked with a clear error."""
        if shape is not None:
            self.check_shape(name, shape)
        return self._read(name, None, dtype)

    def get_slice(self, name: str, axis: int, start: int, stop: int, dtype: str = "float32") -> np.ndarray:
        """``tensor[..., start:stop, ...]`` along ``axis``, reading only that part from disk."""
        return self._read(name, (axis, start, stop), dtype)

    def _read(self, name, window, dtype: str) -> np.ndarray:
        handle, stored = self._handle(name)
        view = handle.get_slice(stored)
        shape = view.get_shape()
        index = tuple(slice(None) for _ in shape)
        if window is not None:
            axis, start, stop = window
            axis = axis % len(shape)
            index = index[:axis] + (slice(start, stop),) + index[axis + 1 :]
        if view.get_dtype() in ("BF16", "bfloat16"):
            array = _bf16_to_float32(self._read_bf16_raw(self._files[name][0], stored)[index])
        else:
            array = view[index]
        return np.ascontiguousarray(array.astype(dtype, copy=False))

    def _read_bf16_raw(self, fname: str, stored: str) -> np.ndarray:
        """safetensors' numpy view cannot represent bfloat16; map the raw bits instead.

        Each shard's header is parsed once: a per-expert MoE shard holds thousands of tensors."""
        if fname not in self._headers:
            with open(fname, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                self._headers[fname] = (8 + header_len, json.loads(f.read(header_len)))
        data_start, header = self._headers[fname]
        meta = header[stored]
        begin, end = meta["data_offsets"]
        raw = np.memmap(fname, dtype=np.uint16, mode="r", offset=data_start + begin, shape=((end - begin) // 2,))
        return raw.reshape(meta["shape"])


# generation_config.json fields a native model hands generate() as its defaults (HF's names)
GENERATION_FIELDS = (
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
)


def generation_defaults(checkpoint: Checkpoint) -> dict:
    """The checkpoint's generation settings (generation_config.json; token ids fall back to
    config.json), which generate() uses for every field the caller does not set, as HF does."""
    defaults = {}
    for name in GENERATION_FIELDS:
        value = checkpoint.generation_config.get(name)
        if value is None and name.endswith("token_id"):
            value = checkpoint.config.get(name)
        if value is not None:
            defaults[name] = value
    return defaults
