"""``hyper-gen bench models``: native models vs HF generate on one checkpoint, and the roofline.

For each shape a random-weight HF Qwen3.5 checkpoint is written once (cached under
``--cache-dir``), then in one run: HF ``generate`` on it, ``load_model(..., backend="torch")``
and ``load_model(..., backend="mindspore")`` through ``hyper_gen.generate``. Reported: prefill
latency, decode tokens/s, and the fraction of the memory-bandwidth roofline, i.e. the decode
rate if every step only had to read the weights once at the machine's measured matrix-vector
bandwidth.
"""

from __future__ import annotations

import os
import time

import numpy as np

from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate

SHAPES = {
    # hidden 512, 8 layers, vocab 32k
    "mid": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=8,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        intermediate_size=1536,
        vocab_size=32000,
        tie_word_embeddings=True,
    ),
    # the Qwen3.5-0.8B text shape
    "0.8b": dict(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        intermediate_size=3584,
        vocab_size=248320,
        tie_word_embeddings=True,
    ),
}


def make_checkpoint(shape: str, cache_dir: str) -> str:
    """A random-weight float32 HF checkpoint of ``shape`` (written once, then reused)."""
    path = os.path.join(cache_dir, f"qwen3_5-{shape}")
    if os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(
        os.path.join(path, "model.safetensors.index.json")
    ):
        return path
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**SHAPES[shape], eos_token_id=None, pad_token_id=0)
    with torch.device("cpu"):
        model = Qwen3_5ForCausalLM(config)
    model.save_pretrained(path, max_shard_size="2GB")
    return path


def matvec_bandwidth(seconds: float = 1.0) -> float:
    """Bytes/s of a float32 matrix-vector product over a 256 MB matrix (torch, this process's threads)."""
    import torch

    w = torch.randn(8192, 8192)
    x = torch.randn(8192, 1)
    w @ x
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        w @ x
        count += 1
    return count * w.numel() * 4 / (time.perf_counter() - start)


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every parameter once (tied embeddings counted once)."""
    total = 0
    params = model.parameters() if hasattr(model, "parameters") else model.get_parameters()
    for p in params:
        total += int(np.prod(p.shape)) * (8 if "64" in str(p.dtype) else 2 if "16" in str(p.dtype) else 4)
    return total


def _timed_generate(run, new_tokens: int, repeats: int):
    """(prefill seconds, decode tokens/s per row) from a 1-token and an n-token run."""
    run(2)
    prefill = min(_seconds(lambda: run(1)) for _ in range(repeats))
    total = min(_seconds(lambda: run(new_tokens)) for _ in range(repeats))
    return prefill, (new_tokens - 1) / max(total - prefill, 1e-9)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_models(args):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    from hyper_gen.models.loading import load_model

    path = make_checkpoint(args.shape, args.cache_dir)
    bandwidth = matvec_bandwidth()
    rng = np.random.default_rng(0)
    ids = rng.integers(3, SHAPES[args.shape]["vocab_size"], (args.batch, args.prompt_len))
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=None)
    rows = []

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bytes_per_step = weight_bytes(hf)
    ids_t = torch.from_numpy(ids)

    def hf_run(n, model=hf):
        return model.generate(
            ids_t, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
        )

    rows.append(("HF generate (torch)",) + _timed_generate(hf_run, args.new_tokens, args.repeats))
    del hf, hf_run  # free the HF weights before loading ours
    for backend in [b.strip() for b in args.backends.split(",")]:
        model = load_model(path, backend=backend, dtype="float32")
        rows.append(
            (f"hyper_gen {backend}",)
            + _timed_generate(
                lambda n, m=model: generate(m, ids, cfg.replace(max_new_tokens=n)), args.new_tokens, args.repeats
            )
        )
        del model

    roofline = bandwidth / bytes_per_step  # steps/s if a step only read the weights
    print(
        f"Qwen3.5 '{args.shape}' random weights, float32, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, torch threads {torch.get_num_threads()}"
    )
    print(
        f"weights {bytes_per_step / 1e9:.2f} GB per step; matrix-vector bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"roofline {roofline:.2f} steps/s"
    )
    print(f"  {'':24s}{'prefill ms':>12s}{'decode tok/s':>14s}{'vs HF':>8s}{'roofline':>10s}")
    hf_rate = rows[0][2]
    for name, prefill, rate in rows:
        print(f"  {name:24s}{prefill * 1e3:12.1f}{rate * args.batch:14.2f}{rate / hf_rate:8.2f}x{rate / roofline:9.0%}")
