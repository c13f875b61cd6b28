"""Read HF checkpoint folders (config.json + safetensors) into numpy, framework-free.

Both backends load weights through this module, so a missing file, a missing tensor or a
misshaped one gets the same clear error everywhere. ``get_slice`` reads only a slice of a tensor
from disk (safetensors is memory-mapped), which is what lets a tensor-parallel rank avoid
materialising the full weights.

Whatever file a user points at, the answer is a ``ValueError`` naming the file and what is wrong
with it, never a framework crash later: an unreadable file ("cannot read FILE: reason"), bad JSON
(line and column), a JSON file that is not an object, a safetensors file that is truncated or not
one, a shard the index names that lacks its tensors, a floating weight stored with an integer
dtype, and NaN / inf in a weight (checked on every array read: one cheap pass).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hyper_gen.config import MODEL_DEFAULT_FIELDS

# text weights of the multimodal checkpoints live under this prefix; we expose them as "model."
_MULTIMODAL_TEXT_PREFIX = "model.language_model."
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.")
# safetensors dtypes a floating weight may be stored in (both spellings safetensors has used)
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "float16", "bfloat16", "float32", "float64")


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


def _cannot_read(file: str, error: OSError) -> ValueError:
    reason = error.strerror or str(error)
    if os.path.islink(file) and not os.path.exists(file):
        reason = f"dangling symlink to {os.readlink(file)!r}"
    return ValueError(f"cannot read {file}: {reason}")


def _check_readable(file: str) -> None:
    """A ValueError "cannot read FILE: reason" unless ``file`` opens for reading (a directory, a
    dangling symlink, no permission)."""
    try:
        with open(file, "rb"):
            pass
    except OSError as error:
        raise _cannot_read(file, error) from None


def _json_kind(value) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a number ({value!r})"
    )


def _read_json_object(file: str) -> dict:
    """The JSON object in ``file``; a ValueError naming the file when it cannot be read, is not
    UTF-8 JSON (with the line and column) or holds something other than an object."""
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except OSError as error:
        raise _cannot_read(file, error) from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{file} is not UTF-8 text (byte {error.start}): not a JSON file") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object ({{...}}), got {_json_kind(value)}")
    return value


def _open_safetensors(file: str):
    """A safetensors handle of ``file`` (header parsed, data memory-mapped), or a ValueError
    naming the file."""
    from safetensors import SafetensorError, safe_open

    _check_readable(file)
    try:
        return safe_open(file, framework="numpy")
    except OSError as error:
        raise _cannot_read(file, error) from None
    except (SafetensorError, ValueError) as error:
        raise ValueError(f"{file} is not a valid safetensors file (truncated or corrupt?): {error}") from None


def _all_finite(array: np.ndarray) -> bool:
    """No NaN / inf in a floating ``array``: the sum is finite (one pass, nothing allocated), or,
    when it is not (a NaN / inf, or finite values whose sum overflows), every element is."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(array.sum()):
            return True
    return bool(np.isfinite(array).all())


# what a Hugging Face Hub model id looks like ("Qwen/Qwen3.5-0.8B"): a path that does not exist and
# reads like one gets the download hint
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def folder_problem(path: str, then: str = "load it from DIR") -> Optional[str]:
    """What keeps ``path`` from being an HF checkpoint folder, in one line, or None: the one wording of
    load_model and the CLI (``then``: how the caller is given the folder, "pass --model DIR").
    A Hub model id gets the download hint: hyper_gen never downloads."""
    if os.path.isdir(path):
        if not os.path.lexists(os.path.join(path, "config.json")):
            return f"model path {path!r} has no config.json: not an HF checkpoint folder"
        return None
    if not os.path.exists(path) and _HUB_ID.fullmatch(path):
        return (
            f"model path {path!r} is not a local folder: hyper_gen reads weights from a local checkpoint folder; "
            f"download it first (e.g. hf download {path} --local-dir DIR) and {then}"
        )
    if not os.path.exists(path):
        return f"model path {path!r} does not exist (expected an HF checkpoint folder)"
    return f"model path {path!r} is not a directory (expected an HF checkpoint folder)"


class Checkpoint:
    """An HF checkpoint folder: its config, generation defaults and tensors by (normalised) name."""

    def __init__(self, path: str):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"model path must be a str or PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        problem = folder_problem(path, "call load_model(DIR, ...)")
        if problem is not None:
            raise ValueError(problem)
        config_file = os.path.join(path, "config.json")
        self.full_config: dict = _read_json_object(config_file)
        self.path = path
        self.config_file = config_file
        architectures = self.full_config.get("architectures") or []
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise ValueError(f"{config_file}: 'architectures' must be a list of strings, got {architectures!r}")
        self.architecture: str = architectures[0] if architectures else ""
        # multimodal checkpoints keep the language model's settings under text_config
        text = self.full_config.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise ValueError(f"{config_file}: 'text_config' must be a JSON object, got {_json_kind(text)}")
        self.config: dict = dict(text) if isinstance(text, dict) else dict(self.full_config)
        # a multimodal model ties its LM head by the top-level flag (HF reads it from the
        # top-level config); text_config's own flag is only a default there
        if "tie_word_embeddings" in self.full_config:
            self.config["tie_word_embeddings"] = self.full_config["tie_word_embeddings"]
        self.config.setdefault("tie_word_embeddings", False)
        self.generation_config: dict = {}
        self.generation_config_file = os.path.join(path, "generation_config.json")
        if os.path.lexists(self.generation_config_file):
            self.generation_config = _read_json_object(self.generation_config_file)
        self._open: Dict[str, object] = {}  # safetensors file -> its handle (every file, opened here)
        self._files = self._index_tensors()
        self._headers: Dict[str, tuple] = {}  # shard file -> (data start, parsed header), bf16 reads

    def _index_tensors(self) -> Dict[str, str]:
        """normalised tensor name -> (file, stored name). Every safetensors file is opened (its
        header parsed) here, so a corrupt one fails before any model is built."""
        index_file = os.path.join(self.path, "model.safetensors.index.json")
        single_file = os.path.join(self.path, "model.safetensors")
        stored: Dict[str, str] = {}
        if os.path.lexists(index_file):
            weight_map = _read_json_object(index_file).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(
                    f"{index_file} must have a 'weight_map' object (tensor name -> shard file name), "
                    f"got {_json_kind(weight_map)}"
                )
            for name, fname in weight_map.items():
                if not isinstance(fname, str):
                    raise ValueError(
                        f"{index_file}: 'weight_map' object entry {name!r} must name a shard file, got {fname!r}"
                    )
            keys: Dict[str, set] = {}
            for name, fname in weight_map.items():
                full = os.path.join(self.path, fname)
                if full not in keys:
                    if not os.path.lexists(full):
                        raise ValueError(f"checkpoint {self.path!r}: shard {fname!r} named in the index is missing")
                    self._open[full] = _open_safetensors(full)
                    keys[full] = set(self._open[full].keys())
                if name not in keys[full]:
                    raise ValueError(
                        f"{index_file} places tensor {name!r} in {full}, which does not hold it "
                        "(a stale or mismatched index)"
                    )
                stored[name] = full
        elif os.path.lexists(single_file):
            self._open[single_file] = _open_safetensors(single_file)
            for name in self._open[single_file].keys():
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
            self._open[fname] = _open_safetensors(fname)
        return self._open[fname], stored

    def file_of(self, name: str) -> str:
        """The safetensors file holding tensor ``name``."""
        self._handle(name)
        return self._files[name][0]

    def check_token_ids(self, vocab_size: int) -> None:
        """The eos / pad ids generate() will take from this checkpoint (generation_config.json, else
        config.json, as ``generation_defaults``) must be ints in [0, vocab_size): a ValueError
        naming the file and the field otherwise, at load, instead of an out-of-range embedding
        lookup in the middle of generate() (a framework error, or an abort of the whole process
        on some backends)."""
        for field in ("eos_token_id", "pad_token_id"):
            value, file = self.generation_config.get(field), self.generation_config_file
            if value is None:
                value, file = self.config.get(field), self.config_file
            if value is None:
                continue
            ids = value if isinstance(value, list) and field == "eos_token_id" else [value]
            for token in ids:
                if isinstance(token, bool) or not isinstance(token, int):
                    kind = "an int or a list of ints" if field == "eos_token_id" else "an int"
                    raise ValueError(f"{file}: {field} must be {kind}, got {value!r}")
                if not 0 <= token < vocab_size:
                    raise ValueError(
                        f"{file}: {field} {value!r} is outside the vocabulary: config.json vocab_size is "
                        f"{vocab_size}, so token ids must be in [0, {vocab_size})"
                    )

    def shape(self, name: str) -> tuple:
        handle, stored = self._handle(name)
        return tuple(handle.get_slice(stored).get_shape())

    def stored_dtype(self, name: str) -> str:
        """The safetensors dtype tensor ``name`` is stored in ("BF16", "F32", ...)."""
        handle, stored = self._handle(name)
        return handle.get_slice(stored).get_dtype()

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
        stored_dtype = view.get_dtype()
        floating = np.dtype(dtype).kind == "f"
        if floating and stored_dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"checkpoint {self.path!r}: tensor {name!r} in {self._files[name][0]} is stored as {stored_dtype}, "
                "but it is a floating weight: expected F16, BF16, F32 or F64 (a corrupt or mis-converted checkpoint)"
            )
        index = tuple(slice(None) for _ in shape)
        if window is not None:
            axis, start, stop = window
            axis = axis % len(shape)
            index = index[:axis] + (slice(start, stop),) + index[axis + 1 :]
        if stored_dtype in ("BF16", "bfloat16"):
            array = _bf16_to_float32(self._read_bf16_raw(self._files[name][0], stored)[index])
        else:
            array = view[index]
        with np.errstate(over="ignore"):  # a float64 value past float32's range: inf, reported below
            array = np.ascontiguousarray(array.astype(dtype, copy=False))
        if floating and not _all_finite(array):
            nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
            raise ValueError(
                f"checkpoint {self.path!r}: tensor {name!r} in {self._files[name][0]} has non-finite values "
                f"({nan} NaN, {inf} inf as {np.dtype(dtype).name}): a corrupt or diverged checkpoint"
            )
        return array

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
GENERATION_FIELDS = MODEL_DEFAULT_FIELDS + ("bos_token_id",)


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
