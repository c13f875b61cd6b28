"""``hyper-gen bench models``: native models vs HF generate on one checkpoint, and the roofline.

For each shape a random-weight HF Qwen3.5 checkpoint is written once (cached under
``--cache-dir``), then in one run: HF ``generate`` on it, ``load_model(..., backend="torch")``
and ``load_model(..., backend="mindspore")`` through ``hyper_gen.generate``. Reported: prefill
latency, decode tokens/s, end-to-end new tokens/s, and two anchors measured on this host in the
same run: the memory-bandwidth roofline (the decode rate if every step only had to read the
weights once at the measured matrix-vector bandwidth) and the compute floor (2 x parameters
FLOPs per new token at the measured GEMM rate for as many rows as the batch has). With
``--min-prompt-len`` below ``--prompt-len`` the batch is left-padded prompts of mixed lengths,
the regime rollouts live in.
"""

from __future__ import annotations

import os
import time

import numpy as np

from hyper_gen import registry
from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.host import describe_host
from hyper_gen.jobs.errors import UsageError
from hyper_gen.models.loading import load_model
from hyper_gen.parallel.launcher import host_ops, init_distributed

SHAPES = {
    # hidden 64, 4 layers (3 Gated DeltaNet, then attention), vocab 1k: smoke runs and tests
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        intermediate_size=128,
        vocab_size=1024,
        tie_word_embeddings=True,
    ),
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
    import torch  # the HF anchor's frameworks, here: `import hyper_gen.bench` imports none
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**SHAPES[shape], eos_token_id=None, pad_token_id=0)
    with torch.device("cpu"):
        model = Qwen3_5ForCausalLM(config)
    model.save_pretrained(path, max_shard_size="2GB")
    return path


def join_with_checkpoint(args, bench: str):
    """For a multi-rank bench: join the launcher's job, one thread per rank (they share the host's
    cores), and the random checkpoint of ``args.shape``, written once by rank 0 and read by all.
    Returns (host ops, rank, world size, what the thread limit did, checkpoint path)."""
    if not init_distributed(args.backend):
        raise UsageError(
            f"{bench} runs on 2 ranks: launch it with torchrun --nproc_per_node 2 -m hyper_gen bench {bench} "
            f"(or msrun --worker_num=2 --local_worker_num=2 --join=True hyper_gen/__main__.py bench {bench} "
            "--backend mindspore)"
        )
    ops = host_ops(args.backend)
    rank, world = ops.rank(), ops.world_size()
    threads = registry.adapter(args.backend).limit_threads(1)
    if rank == 0:
        make_checkpoint(args.shape, args.cache_dir)
    ops.all_reduce(ops.asarray(np.zeros(1, np.float32)))  # rank 0 has written the checkpoint
    return ops, rank, world, threads, make_checkpoint(args.shape, args.cache_dir)


def _kernels(rows: int, inner: int, out: int):
    """The float32 CPU products torch can run for (rows, inner) @ (inner, out) on this host: MKL's
    ``x @ w`` and, where the build has it, oneDNN's packed product (the torch adapter's ``cpu_products``)."""
    import torch  # the anchors' framework, here: `import hyper_gen.bench` imports none

    x = torch.randn(rows, inner)
    w = torch.randn(inner, out)
    return registry.adapter("torch").cpu_products(x, w)


def _best_rate(kernels, units: float, seconds: float) -> float:
    """``units`` per second of the fastest of ``kernels``, each run for about ``seconds``."""
    best = 0.0
    for kernel in kernels:
        kernel()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            kernel()
            count += 1
        best = max(best, count * units / (time.perf_counter() - start))
    return best


def matvec_bandwidth(seconds: float = 1.0) -> float:
    """Bytes/s of a float32 matrix-vector product over a 256 MB matrix (torch, this process's
    threads), the faster of MKL's and oneDNN's: the memory roofline's rate."""
    return _best_rate(_kernels(1, 8192, 8192), 8192 * 8192 * 4, seconds)


def gemm_flops(rows: int, size: int = 2048, seconds: float = 1.0) -> float:
    """FLOP/s of a float32 (rows x size) @ (size x size) product (torch, this process's threads),
    the faster of MKL's and oneDNN's: the rate a batched decode step's projections can reach at
    best on this host."""
    return _best_rate(_kernels(rows, size, size), 2 * rows * size * size, seconds)


def prompt_batch(batch: int, longest: int, shortest: int, vocab: int):
    """(ids, mask): ``batch`` left-padded prompts with lengths spread evenly from ``shortest`` to ``longest``."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, (batch, longest))
    lengths = np.linspace(longest, shortest, batch).round().astype(int) if batch > 1 else np.array([longest])
    mask = (np.arange(longest)[None, :] >= (longest - lengths)[:, None]).astype(np.int64)
    return np.where(mask == 1, ids, 0), mask


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every parameter once (tied embeddings counted once)."""
    total = 0
    params = model.parameters() if hasattr(model, "parameters") else model.get_parameters()
    for p in params:
        total += int(np.prod(p.shape)) * (8 if "64" in str(p.dtype) else 2 if "16" in str(p.dtype) else 4)
    return total


def _timed_generate(run, new_tokens: int, repeats: int):
    """(prefill seconds, decode steps/s, end-to-end seconds) from a 1-token and an n-token run."""
    run(2)
    prefill = min(_seconds(lambda: run(1)) for _ in range(repeats))
    total = min(_seconds(lambda: run(new_tokens)) for _ in range(repeats))
    return prefill, (new_tokens - 1) / max(total - prefill, 1e-9), total


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_models(args):
    import torch  # the HF anchor's frameworks, here: `import hyper_gen.bench` imports none
    import transformers

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = make_checkpoint(args.shape, args.cache_dir)
    bandwidth = matvec_bandwidth()
    flops = gemm_flops(args.batch)
    shortest = args.min_prompt_len or args.prompt_len
    ids, mask = prompt_batch(args.batch, args.prompt_len, shortest, SHAPES[args.shape]["vocab_size"])
    padded = bool((mask == 0).any())
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=None)
    rows, plans = [], []

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bytes_per_step = weight_bytes(hf)
    params = bytes_per_step // 4
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask) if padded else None
    our_mask = mask if padded else None

    def hf_run(n, model=hf):
        return model.generate(
            ids_t,
            attention_mask=mask_t,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )

    rows.append(("HF generate (torch)",) + _timed_generate(hf_run, args.new_tokens, args.repeats))
    del hf, hf_run  # free the HF weights before loading ours
    for backend in [b.strip() for b in args.backends.split(",")]:
        model = load_model(path, backend=backend, dtype="float32", kernels=args.kernels)
        plans.append(model.kernel_plan)
        rows.append(
            (f"hyper_gen {backend}",)
            + _timed_generate(
                lambda n, m=model: generate(m, ids, cfg.replace(max_new_tokens=n), attention_mask=our_mask),
                args.new_tokens,
                args.repeats,
            )
        )
        del model

    roofline = bandwidth / bytes_per_step  # steps/s if a step only read the weights
    floor = flops / (2 * params)  # new tokens/s if every FLOP ran at the batch's GEMM rate
    prompts = f"prompts {shortest}-{args.prompt_len} (left-padded)" if padded else f"prompt {args.prompt_len}"
    print(describe_host(torch.get_num_threads()))
    print(
        f"Qwen3.5 '{args.shape}' random weights, float32, batch {args.batch}, {prompts}, "
        f"{args.new_tokens} new tokens, torch threads {torch.get_num_threads()}"
    )
    print(
        f"weights {bytes_per_step / 1e9:.2f} GB per step; matrix-vector bandwidth {bandwidth / 1e9:.1f} GB/s -> "
        f"roofline {roofline:.2f} steps/s; GEMM ({args.batch} rows) {flops / 1e9:.1f} GFLOP/s -> compute floor "
        f"{floor:.1f} new tok/s"
    )
    print(
        f"  {'':24s}{'prefill ms':>12s}{'decode tok/s':>14s}{'e2e tok/s':>11s}{'vs HF':>8s}{'roofline':>10s}"
        f"{'compute':>9s}"
    )
    hf_e2e = rows[0][3]
    new_tokens = args.batch * args.new_tokens
    for name, prefill, rate, total in rows:
        decode = rate * args.batch
        print(
            f"  {name:24s}{prefill * 1e3:12.1f}{decode:14.2f}{new_tokens / total:11.2f}{hf_e2e / total:8.2f}x"
            f"{rate / roofline:9.0%}{decode / floor:9.0%}"
        )
    print("vs HF: end-to-end; roofline: decode steps/s over the roofline; compute: decode tok/s over the floor")
    for plan in plans:
        print(plan)
