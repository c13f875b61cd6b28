"""``hyper-gen bench loop``: the generate loop's own cost per decode step, outside the forward."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

import hyper_gen.generation as generation_module
from hyper_gen import registry
from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.host import describe_host


# ---- the loop's own cost ------------------------------------------------------------------
class _CountingOps:
    """Wraps an Ops and counts calls by name (to report ops per step)."""

    def __init__(self, ops):
        self._ops = ops
        self.calls = Counter()

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        if not callable(attr) or name in ("no_grad", "param_dtype", "world_size", "rank", "is_tensor"):
            return attr
        calls = self.calls

        def counted(*args, **kwargs):
            calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def _null_model(framework: str, batch: int, vocab: int):
    """A cache-object model whose forward only returns fixed random logits: all time is the loop's."""
    logits = np.random.default_rng(0).normal(0, 3, (batch, 1, vocab)).astype(np.float32)
    return registry.adapter(framework).fixed_logits_model(logits)


LOOP_SETTINGS = {
    "greedy": dict(do_sample=False),
    "sample top-k+top-p (seed=int)": dict(do_sample=True, top_k=50, top_p=0.9, seed=0),
    "sample top-k+top-p (seed=None)": dict(do_sample=True, top_k=50, top_p=0.9),
}


def loop_overhead(framework: str, setting: str, batch: int = 4, vocab: int = 32000, steps: int = 64):
    """(ms per step outside the forward, ops per decode step by name)."""
    model = _null_model(framework, batch, vocab)
    cfg = GenerationConfig(max_new_tokens=steps, eos_token_id=None, **LOOP_SETTINGS[setting])
    prompt = np.arange(1, 9)[None, :].repeat(batch, 0)
    generate(model, prompt, cfg.replace(max_new_tokens=4))  # warm up kernels
    real_backend_for = registry.backend_for
    counted = {}

    def counting_backend_for(*objects):
        counted["ops"] = _CountingOps(real_backend_for(*objects))
        return counted["ops"]

    generation_module.backend_for = counting_backend_for
    try:
        model.forward_seconds = 0.0
        start = time.perf_counter()
        generate(model, prompt, cfg)
        total = time.perf_counter() - start
    finally:
        generation_module.backend_for = real_backend_for
    per_step = (total - model.forward_seconds) / steps * 1e3
    calls = {name: round(n / steps, 2) for name, n in sorted(counted["ops"].calls.items())}
    return per_step, calls


def run_loop(args):
    frameworks = [f.strip() for f in args.backends.split(",")]
    print(describe_host())
    print(f"decode-loop time outside the model forward, B={args.batch}, V={args.vocab}, {args.steps} steps")
    print(f"{'setting':34s}" + "".join(f"{f:>14s}" for f in frameworks))
    ops_report = {}
    for setting in LOOP_SETTINGS:
        cells = []
        for framework in frameworks:
            ms_per_step, calls = loop_overhead(framework, setting, args.batch, args.vocab, args.steps)
            cells.append(f"{ms_per_step:11.3f} ms")
            ops_report[(framework, setting)] = calls
        print(f"{setting:34s}" + "".join(f"{c:>14s}" for c in cells))
    print("\nbackend ops per decode step (protocol calls):")
    for (framework, setting), calls in ops_report.items():
        print(f"  {framework:9s} {setting:34s} {sum(calls.values()):5.1f}  {calls}")
