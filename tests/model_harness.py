"""Driving a native Qwen3.5 port (torch or MindSpore) and its HF reference, framework-neutrally.

The model-conformance suite (tests/test_model_conformance.py) runs every model check on both
backends through a :class:`TorchPort` / :class:`MindSporePort` (``port(name)``): how to build the
framework's tensors and cache ops, run the native forward and read its logits back as numpy.
:func:`run_native` drives a port's model through the cache-object contract (docs/model_contract.md):
a StaticCache or DynamicCache, additive masks built here, prefill then teacher-forced decode steps.
:class:`HFReference` is HF's own cached run on the same tokens.

float64 references: both ports compute everything in float64 in a float64 model (the norms, rotary
angles, router softmax and the delta rule too); HF upcasts those to float32 even in a float64 model,
so the reference is HF made to compute them in float64 (:func:`hf_in_float64`, exact rotary
frequencies too): then both agree to ~1e-14 whatever the chunk boundaries.

Frameworks are imported directly: a test that needs one fails, never skips, when it is missing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import numpy as np
import torch
from qwen_checkpoints import TINY_TEXT_CONFIG, load_hf

from hyper_gen.cache import DynamicCache, StaticCache

BACKENDS = ("torch", "mindspore")  # the keys of PORTS, in test order
TINY_VOCAB = TINY_TEXT_CONFIG["vocab_size"]
FORWARD_PARAMETERS = ["input_ids", "position_ids", "attention_mask", "past_key_values", "logits_to_keep"]


# ----------------------------------------------------------------------------------- the ports


class TorchPort:
    name = "torch"

    def __init__(self):
        from hyper_gen.backends.torch.models import qwen3_5
        from hyper_gen.backends.torch.ops import TorchOps

        self.native = qwen3_5
        self.module_class = torch.nn.Module
        self._ops = TorchOps

    def ops(self):
        return self._ops("cpu")

    def dtype(self, name):
        return getattr(torch, name)

    def dtype_name(self, dtype):
        return str(dtype).rsplit(".", 1)[-1]

    def tensor(self, array, dtype=None):
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if dtype is None else tensor.to(self.dtype(dtype))

    def additive_mask(self, visible, dtype):
        """0 where ``visible`` (a numpy bool array), the dtype's most negative value elsewhere."""
        dtype = self.dtype(dtype)
        return torch.zeros(visible.shape, dtype=dtype).masked_fill(~torch.from_numpy(visible), torch.finfo(dtype).min)

    def numpy(self, tensor):
        """The tensor as numpy in its own dtype (bfloat16, which numpy lacks, as float32)."""
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()

    def forward(self, model, input_ids, **kwargs):
        """The model's logits (a native tensor) for numpy ``input_ids``."""
        with torch.no_grad():
            return model(self.tensor(input_ids), **kwargs)["logits"]

    def named_parameters(self, model):
        return list(model.named_parameters())

    def state(self, model):
        """Every tensor the model holds (parameters and buffers), by name."""
        return list(model.state_dict().items())

    def requires_grad(self, param):
        return param.requires_grad

    def entry(self, model):
        return model.forward


class MindSporePort:
    name = "mindspore"

    def __init__(self):
        import mindspore

        from hyper_gen.backends.mindspore import configure
        from hyper_gen.backends.mindspore.models import qwen3_5
        from hyper_gen.backends.mindspore.ops import MindSporeOps

        configure("CPU")
        self.ms = mindspore
        self.native = qwen3_5
        self.module_class = mindspore.nn.Cell
        self._ops = MindSporeOps

    def ops(self):
        return self._ops()

    def dtype(self, name):
        return getattr(self.ms, name)

    def dtype_name(self, dtype):
        ms = self.ms
        return {ms.float16: "float16", ms.bfloat16: "bfloat16", ms.float32: "float32", ms.float64: "float64"}[dtype]

    def tensor(self, array, dtype=None):
        array = np.ascontiguousarray(array)
        return self.ms.Tensor(array if dtype is None else array.astype(dtype))

    def additive_mask(self, visible, dtype):
        np_dtype = np.dtype(dtype)
        return self.ms.Tensor(np.where(visible, 0, np.finfo(np_dtype).min).astype(np_dtype))

    def numpy(self, tensor):
        return tensor.asnumpy()

    def forward(self, model, input_ids, **kwargs):
        return model(self.tensor(input_ids), **kwargs)["logits"]

    def named_parameters(self, model):
        return [(param.name, param) for param in model.get_parameters()]

    def state(self, model):
        return list(model.parameters_and_names())

    def requires_grad(self, param):
        return param.requires_grad

    def entry(self, model):
        return model.construct


PORTS = {"torch": TorchPort, "mindspore": MindSporePort}


@functools.lru_cache(maxsize=None)
def port(name):
    return PORTS[name]()


def signature(function):
    return list(inspect.signature(function).parameters)


# ----------------------------------------------------------------------- driving a native model


def contract_mask(prompt_mask, past, seq, total):
    """(B, 1, seq, total) visibility: causal + padding columns + unwritten static columns."""
    batch, prompt_len = prompt_mask.shape
    real = np.ones((batch, total), bool)
    real[:, :prompt_len] = prompt_mask.astype(bool)
    rows = np.arange(past, past + seq)[:, None]
    visible = (np.arange(total)[None, :] <= rows)[None] & real[:, None, :]
    return visible[:, None]


def positions_of(prompt_mask):
    """Position ids of a left-padded batch: 0.. over each row's real tokens, 0 on padding."""
    return (np.maximum(prompt_mask.cumsum(1) - 1, 0) * prompt_mask).astype(np.int64)


class Logits(list):
    """Each call's logits as numpy, [(B, L, V), (B, 1, V), ...], and ``dtypes``: the dtype
    names of the native logits (numpy has no bfloat16: those are float32 here)."""

    dtypes: set


def run_native(port, model, input_ids, prompt_mask, decode_ids, cache_kind, extra_length=3):
    """Prefill then one decode step per column of ``decode_ids`` (numpy int arrays) with a
    hyper_gen cache; returns each call's :class:`Logits`."""
    batch, prompt_len = input_ids.shape
    dtype = port.dtype_name(model.dtype)
    cache_class = StaticCache if cache_kind == "static" else DynamicCache
    cache = cache_class(port.ops(), batch, prompt_len + decode_ids.shape[1] + extra_length)
    padded = not bool(prompt_mask.all())
    cache.prompt_mask = port.tensor(prompt_mask, dtype) if padded else None

    def mask(seq):
        total = cache.max_length if cache_kind == "static" else cache.seq_length + seq
        return port.additive_mask(contract_mask(prompt_mask, cache.seq_length, seq, total), dtype)

    lengths = prompt_mask.sum(1)
    outputs = Logits()
    outputs.dtypes = set()
    logits = port.forward(
        model,
        input_ids,
        position_ids=port.tensor(positions_of(prompt_mask)),
        attention_mask=mask(prompt_len),
        past_key_values=cache,
    )
    outputs.append(port.numpy(logits))
    outputs.dtypes.add(port.dtype_name(logits.dtype))
    cache.advance(prompt_len)
    for step in range(decode_ids.shape[1]):
        logits = port.forward(
            model,
            decode_ids[:, step : step + 1],
            position_ids=port.tensor((lengths + step)[:, None].astype(np.int64)),
            attention_mask=mask(1),
            past_key_values=cache,
            logits_to_keep=1,
        )
        outputs.append(port.numpy(logits))
        outputs.dtypes.add(port.dtype_name(logits.dtype))
        cache.advance(1)
    return outputs


def row_of(outputs, row, length):
    """One row of a left-padded run: its ``length`` real prefill positions, then its decode steps."""
    return [outputs[0][row : row + 1, -length:]] + [step[row : row + 1] for step in outputs[1:]]


def max_error(ours, reference):
    return max(
        float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()) for a, b in zip(ours, reference)
    )


class Tokens:
    """Random token ids (numpy int64), drawn in call order from a seeded generator: ``source``
    "torch" (``torch.randint`` over the vocabulary: the torch model suite's draws) or "numpy"
    (a numpy Generator over ids 1..V-1: the MindSpore model suite's draws)."""

    def __init__(self, seed, source="torch"):
        self.source = source
        if source == "torch":
            self.generator = torch.Generator().manual_seed(seed)
        else:
            self.rng = np.random.default_rng(seed)

    def __call__(self, shape):
        if self.source == "torch":
            return torch.randint(0, TINY_VOCAB, shape, generator=self.generator).numpy()
        return self.rng.integers(1, TINY_VOCAB, shape).astype(np.int64)

    def rows(self, rows, steps):
        """(rows, steps) decode ids; numpy draws them one row at a time."""
        if self.source == "torch":
            return self((rows, steps))
        return np.stack([self((steps,)) for _ in range(rows)])


def padded_batch(tokens, lengths):
    """Prompts of ``lengths`` left-padded (pad id 0) into one batch: (prompts, input_ids, prompt_mask)."""
    prompts = [tokens((n,)) for n in lengths]
    width = max(lengths)
    input_ids = np.zeros((len(lengths), width), np.int64)
    prompt_mask = np.zeros((len(lengths), width), np.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        prompt_mask[row, width - len(prompt) :] = 1
    return prompts, input_ids, prompt_mask


# --------------------------------------------------------------------------------- HF reference


class _Float64Torch:
    """``torch`` as HF's Qwen3.5 modules see it inside :func:`hf_in_float64`: float32 is float64."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def hf_in_float64():
    """HF computes norms, rotary angles, softmax, the router and the delta rule in float32 even
    in a float64 model (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float``); here those
    compute in float64 instead."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense_module
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe_module

    to_float = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else to_float(self, *a, **k)
    dense_module.torch = moe_module.torch = _Float64Torch()
    try:
        yield
    finally:
        dense_module.torch = moe_module.torch = torch
        torch.Tensor.float = to_float


class HFReference:
    """HF transformers' model of a checkpoint; ``exact``: a float64 model computing in float64
    (inside :func:`hf_in_float64`, exact rotary frequencies), else HF as is."""

    def __init__(self, path, dtype, exact=False):
        self.exact = exact and dtype == "float64"
        self.model = load_hf(path, dtype)
        if self.exact:  # exact rotary frequencies (HF computes them in float32)
            for module in self.model.modules():
                if type(module).__name__.endswith("TextRotaryEmbedding"):
                    dim = module.inv_freq.shape[0] * 2
                    base = module.config.rope_parameters["rope_theta"]
                    module.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def _context(self):
        return hf_in_float64() if self.exact else contextlib.nullcontext()

    def logits(self, input_ids):
        """A cacheless forward over numpy ``input_ids``: (B, L, V) float64 numpy."""
        with self._context(), torch.no_grad():
            return self.model(torch.from_numpy(input_ids)).logits.double().numpy()

    def run(self, input_ids, decode_ids, prompt_mask=None):
        """HF's own cached run: prefill, then one token per step with its cache; with
        ``prompt_mask`` (left padding) HF is given that mask and the matching positions."""
        input_ids, decode_ids = torch.from_numpy(input_ids), torch.from_numpy(decode_ids)
        attention_mask = position_ids = None
        if prompt_mask is not None:
            attention_mask = torch.from_numpy(prompt_mask)
            position_ids = torch.from_numpy(positions_of(prompt_mask))
        outputs = []
        with self._context(), torch.no_grad():
            out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
            outputs.append(out.logits.double().numpy())
            for step in range(decode_ids.shape[1]):
                kwargs = {}
                if attention_mask is not None:
                    attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], 1)
                    kwargs["attention_mask"] = attention_mask
                    kwargs["position_ids"] = position_ids[:, -1:] + 1 + step
                out = self.model(
                    decode_ids[:, step : step + 1], past_key_values=out.past_key_values, use_cache=True, **kwargs
                )
                outputs.append(out.logits.double().numpy())
        return outputs
