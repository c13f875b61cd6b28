"""Benchmarks, each printing hyper_gen next to its anchor in one run.

- ``loop``: time per decode step spent outside the model's forward, torch and MindSpore side by
  side (B=4, V=32k by default), greedy and sampling, plus the backend ops each step issues.
- ``hf``: HF ``generate`` vs ``hyper_gen.generate`` on the same HF Qwen3.5 model (decode tokens/s).
- ``models``: native ``load_model`` (torch, MindSpore) vs HF generate on one checkpoint shape:
  prefill latency, decode tokens/s and the fraction of the memory-bandwidth roofline.
- ``tp``: TP=2 vs TP=1 under torchrun / msrun, with the bytes moved through collectives.

Run: ``hyper-gen bench [loop|hf|models|tp] ...`` or ``python -m hyper_gen.bench ...``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter

import numpy as np

from .config import GenerationConfig
from .generation import generate


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
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (batch, 1, vocab)).astype(np.float32)
    if framework == "torch":
        import torch

        class NullTorch(torch.nn.Module):
            supports_cache_object = True

            def __init__(self):
                super().__init__()
                self.logits = torch.nn.Parameter(torch.from_numpy(logits), requires_grad=False)
                self.forward_seconds = 0.0

            def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None,
                        logits_to_keep=0):
                start = time.perf_counter()
                out = {"logits": self.logits}
                self.forward_seconds += time.perf_counter() - start
                return out

        return NullTorch()
    import mindspore as ms

    class NullMindSpore(ms.nn.Cell):
        supports_cache_object = True

        def __init__(self):
            super().__init__()
            self.logits = ms.Parameter(ms.Tensor(logits), requires_grad=False)
            self.forward_seconds = 0.0

        def construct(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None,
                      logits_to_keep=0):
            start = time.perf_counter()
            out = {"logits": self.logits}
            self.forward_seconds += time.perf_counter() - start
            return out

    return NullMindSpore()


LOOP_SETTINGS = {
    "greedy": dict(do_sample=False),
    "sample top-k+top-p (seed=int)": dict(do_sample=True, top_k=50, top_p=0.9, seed=0),
    "sample top-k+top-p (seed=None)": dict(do_sample=True, top_k=50, top_p=0.9),
}


def loop_overhead(framework: str, setting: str, batch: int = 4, vocab: int = 32000, steps: int = 64):
    """(ms per step outside the forward, ops per decode step by name)."""
    from . import ops as ops_module

    model = _null_model(framework, batch, vocab)
    cfg = GenerationConfig(max_new_tokens=steps, eos_token_id=None, **LOOP_SETTINGS[setting])
    prompt = np.arange(1, 9)[None, :].repeat(batch, 0)
    generate(model, prompt, cfg.replace(max_new_tokens=4))  # warm up kernels
    real_backend_for = ops_module.backend_for
    counted = {}

    def counting_backend_for(*objects):
        counted["ops"] = _CountingOps(real_backend_for(*objects))
        return counted["ops"]

    import hyper_gen.generation as generation_module

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


# ---- HF generate vs hyper_gen on the same HF model -----------------------------------------
def _hf_qwen35(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    heads = max(hidden // 64, 2)
    cfg = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                            head_dim=64, linear_num_key_heads=heads, linear_num_value_heads=heads,
                            linear_key_head_dim=64, linear_value_head_dim=64)
    return Qwen3_5ForCausalLM(cfg).eval()


def _time(fn, repeats: int):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_hf(args):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads) if args.threads else None
    model = _hf_qwen35(args.hidden, args.layers, args.vocab)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt_len))
    new = args.new_tokens

    def hf(n):
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                      eos_token_id=None)

    def ours(n):
        return lambda: generate(model, ids, GenerationConfig(max_new_tokens=n, eos_token_id=None))

    rows = []
    for name, make in (("HF generate", hf), ("hyper_gen.generate", ours)):
        prefill = _time(make(1), args.repeats)
        total = _time(make(new), args.repeats)
        rows.append((name, prefill, (new - 1) * args.batch / (total - prefill)))
    print(f"HF Qwen3.5 hidden={args.hidden} layers={args.layers} vocab={args.vocab} B={args.batch} "
          f"prompt={args.prompt_len} new={new} threads={torch.get_num_threads()}")
    for name, prefill, tps in rows:
        print(f"  {name:20s} prefill {prefill * 1e3:8.1f} ms   decode {tps:8.1f} tok/s")
    print(f"  hyper_gen / HF decode speed: {rows[1][2] / rows[0][2]:.3f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hyper-gen bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which")
    loop = sub.add_parser("loop", help="loop time outside the forward, torch vs MindSpore")
    loop.add_argument("--backends", default="torch,mindspore")
    loop.add_argument("--batch", type=int, default=4)
    loop.add_argument("--vocab", type=int, default=32000)
    loop.add_argument("--steps", type=int, default=64)
    hf = sub.add_parser("hf", help="HF generate vs hyper_gen.generate on one HF Qwen3.5 model")
    hf.add_argument("--hidden", type=int, default=256)
    hf.add_argument("--layers", type=int, default=4)
    hf.add_argument("--vocab", type=int, default=32000)
    hf.add_argument("--batch", type=int, default=4)
    hf.add_argument("--prompt-len", type=int, default=32)
    hf.add_argument("--new-tokens", type=int, default=32)
    hf.add_argument("--repeats", type=int, default=3)
    hf.add_argument("--threads", type=int, default=0)
    models = sub.add_parser("models", help="load_model (torch, MindSpore) vs HF generate, and the roofline")
    models.add_argument("--shape", default="mid", choices=["mid", "0.8b"])
    models.add_argument("--backends", default="torch,mindspore")
    models.add_argument("--batch", type=int, default=1)
    models.add_argument("--prompt-len", type=int, default=32)
    models.add_argument("--new-tokens", type=int, default=16)
    models.add_argument("--repeats", type=int, default=2)
    models.add_argument("--threads", type=int, default=0)
    models.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "hyper_gen_bench"))
    tp = sub.add_parser("tp", help="TP=2 vs TP=1 under torchrun / msrun")
    tp.add_argument("--backend", default="torch", choices=["torch", "mindspore"])
    tp.add_argument("--shape", default="mid", choices=["mid", "0.8b"])
    tp.add_argument("--batch", type=int, default=1)
    tp.add_argument("--prompt-len", type=int, default=32)
    tp.add_argument("--new-tokens", type=int, default=16)
    tp.add_argument("--repeats", type=int, default=2)
    tp.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "hyper_gen_bench"))
    args = parser.parse_args(argv)
    if args.which == "tp":
        from .bench_tp import run_tp

        run_tp(args)
    elif args.which == "hf":
        run_hf(args)
    elif args.which == "models":
        from .bench_models import run_models

        run_models(args)
    else:
        if args.which is None:
            args = parser.parse_args(["loop"] + list(argv or []))
        run_loop(args)


if __name__ == "__main__":
    main()
