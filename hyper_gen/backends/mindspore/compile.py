"""When and how a MindSpore model's one-token blocks run as compiled graphs (``mindspore.jit``):
``block`` jits a ``*_rows`` function once per (function, sizes) or calls it as it is (the same
bits); ``CompileGate`` decides which steps run compiled (docs/architecture.md, "MindSpore on CPU")."""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Dict

import mindspore as ms
from mindspore import Tensor

from hyper_gen import switches

# True (default): one-token forwards run the compiled blocks; False ($HYPER_GEN_MINDSPORE_JIT=0): all
# PyNative. A new batch size compiles once (~1-3 s on CPU) before its first step. (Read at import;
# a value other than 0 / 1 is load()'s ValueError, check_switches.)
COMPILED_DECODE = os.environ.get("HYPER_GEN_MINDSPORE_JIT", "1") != "0"
# A dynamic cache's one-token steps (the in-flight engine's, whose batch changes size as requests
# join and leave) run the compiled blocks only from the step at which their batch size has been
# decoded this many times: rent until the rent paid would have bought the compile (compiling a
# batch size's graphs costs about as much as this many PyNative steps lose on the mid shape:
# docs/performance.md). Counted over the model's life, so the PyNative steps are bounded (sizes x
# this) and every size in steady use ends up compiled. A static cache's steps (generate's default:
# one batch size a call) compile at once. Per model: ``decode_compile_after``.
DYNAMIC_COMPILE_AFTER = 256
# Positions a static cache's length is rounded up to when the decode step is one graph (compiled
# for the buffers' shape): every prompt + max_new_tokens in a bucket shares the graph; the extra
# positions cost a few masked attention columns a step
STATIC_CACHE_MULTIPLE = 256


def check_switches() -> None:
    """This backend's environment switches read once, at load: a bad value is a ValueError naming
    it before any work (``hyper_gen.switches``)."""
    switches.flag("HYPER_GEN_MINDSPORE_JIT")


class CompileGate:
    """Which one-token steps run compiled: none with ``COMPILED_DECODE`` off; else every
    static-cache step, and a dynamic-cache step once its batch size has been decoded ``after``
    times (``DYNAMIC_COMPILE_AFTER``). Every rank of a model sees the same sizes, so every rank
    decides the same."""

    def __init__(self):
        self.seen: Dict[int, int] = {}

    def allows(self, batch: int, static: bool, after: int) -> bool:
        if not COMPILED_DECODE:
            return False
        if static:
            return True
        self.seen[batch] = self.seen.get(batch, 0) + 1
        return self.seen[batch] >= after


def block(function, *static, compiled: bool):
    """``function`` with its leading ``static`` arguments (sizes, dtypes) bound: its compiled graph
    (``jitted``) when ``compiled``, else the function itself, run op by op (PyNative)."""
    return jitted(function, *static) if compiled else functools.partial(function, *static)


_COMPILED: Dict[tuple, object] = {}


def jitted(function, *static):
    """The graph of ``function(*static, *args)``, jitted once per (function, static), called with
    contiguous tensors only. MindSpore 2.10 reuses a graph for an input of the same shape whatever
    its strides, and a view op inside it (``mint.transpose`` of the conv state) reads an input with
    the strides of an earlier call's: a contiguous tensor after a transposed view of the same shape
    is read transposed (wrong values, not rounding). The in-flight engine's join / drop hand the
    graphs contiguous caches between steps whose inputs were the graphs' own (view) outputs."""
    key = (function,) + static
    graph = _COMPILED.get(key)
    if graph is None:

        def bound(*args):
            return function(*static, *args)

        bound.__name__ = function.__name__  # MindSpore names the graph (and its recompile warnings) by it
        run = ms.jit(bound)

        def graph(*args):
            args = [a.contiguous() if isinstance(a, Tensor) and not a.is_contiguous() else a for a in args]
            if threading.current_thread() is not threading.main_thread():
                return run(*args)
            return keeping_ctrl_c(run, args)

        _COMPILED[key] = graph
    return graph


def keeping_ctrl_c(run, args):
    """Run a graph so that Ctrl-C stays a KeyboardInterrupt. Each run of a MindSpore 2.10 graph
    installs MindSpore's own SIGINT handler, which answers Ctrl-C by sending the process SIGTERM: a
    JSONL job would die (exit -15) instead of stopping cleanly (exit 130, every finished row kept).
    During the run a default SIGTERM becomes a KeyboardInterrupt; afterwards Python's SIGINT
    handler is put back and SIGTERM's default restored (a few us a call)."""
    interrupt, terminate = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    converting = terminate is signal.SIG_DFL
    if converting:
        signal.signal(signal.SIGTERM, _sigterm_as_keyboard_interrupt)
    try:
        out = run(*args)
        _handle_pending_signals()  # a SIGTERM sent during the run raises here, before the restore
        return out
    finally:
        if interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)
        if converting:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _sigterm_as_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _handle_pending_signals():
    """Nothing: calling a Python function lets the interpreter run pending signal handlers."""
