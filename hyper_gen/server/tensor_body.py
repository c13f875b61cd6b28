"""Named tensors in a request body (``POST /update_weights_from_tensor``): safetensors bytes, base64.

Each item of ``serialized_named_tensors`` is the base64 text of a safetensors file (what
``safetensors.torch.save(dict)`` / ``safetensors.numpy.save(dict)`` return; bfloat16 included),
decoded here with numpy alone, so both backends take it. SGLang's own form (its
``MultiprocessingSerializer``: a pickle) is refused with a 400 that says so: unpickling a request
body runs whatever code the body names.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from typing import List, Tuple

import numpy as np

from hyper_gen.models.checkpoint import _bf16_to_float32

from .errors import bad_value

_NUMPY = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_PICKLE = b"\x80"  # a pickle's first byte (protocol 2 and later)


def decode(text: str, param: str) -> List[Tuple[str, np.ndarray]]:
    """``[(name, array)]`` of one base64 safetensors item; a 400 naming ``param`` if it is not one."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_value(param, f"{param} must be base64 text of safetensors bytes: {exc}") from None
    if raw.startswith(_PICKLE):
        raise bad_value(
            param,
            f"{param} holds a pickle (SGLang's MultiprocessingSerializer), which this server does not unpickle "
            "(it would run code the request names): send base64 safetensors bytes, e.g. "
            "base64.b64encode(safetensors.torch.save(named_tensors)).decode()",
        )
    if len(raw) < 8:
        raise bad_value(param, f"{param} is {len(raw)} bytes, too short for a safetensors header")
    (size,) = struct.unpack("<Q", raw[:8])
    if size > len(raw) - 8:
        raise bad_value(param, f"{param}: the safetensors header says {size} bytes, the item has {len(raw) - 8}")
    try:
        header = json.loads(raw[8 : 8 + size])
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_value(param, f"{param}: the safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad_value(param, f"{param}: the safetensors header is not a JSON object")
    data = memoryview(raw)[8 + size :]
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad_value(param, f"{param}: tensor {name!r} has no dtype, shape and data_offsets") from None
        if dtype != "BF16" and dtype not in _NUMPY:
            raise bad_value(param, f"{param}: tensor {name!r} has dtype {dtype}, which this server cannot take")
        item = 2 if dtype == "BF16" else np.dtype(_NUMPY[dtype]).itemsize
        count = int(np.prod(shape, dtype=np.int64))
        if not (0 <= begin <= end <= len(data)) or end - begin != count * item:
            raise bad_value(param, f"{param}: tensor {name!r}'s data_offsets disagree with its shape {shape}")
        chunk = data[begin:end]
        if dtype == "BF16":
            array = _bf16_to_float32(np.frombuffer(chunk, dtype=np.uint16)).reshape(shape)
        else:
            array = np.frombuffer(chunk, dtype=_NUMPY[dtype]).reshape(shape)
        out.append((name, array))
    return out
