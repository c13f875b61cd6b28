"""Benchmarks, each printing hyper_gen next to its anchor in one run.

- ``loop``: time per decode step spent outside the model's forward, torch and MindSpore side by
  side (B=4, V=32k by default), greedy and sampling, plus the backend ops each step issues.
- ``hf``: HF ``generate`` vs ``hyper_gen.generate`` on the same HF Qwen3.5 model (decode tokens/s).
- ``models``: native ``load_model`` (torch, MindSpore) vs HF generate on one checkpoint shape:
  prefill latency, decode tokens/s and the fraction of the memory-bandwidth roofline.
- ``tp``: TP=2 vs TP=1 under torchrun / msrun, with the bytes moved through collectives.
- ``cp``: CP=2 vs CP=1 under torchrun / msrun on a long prompt (2048 tokens): prefill latency,
  decode tokens/s and the KV-cache + state bytes each rank holds.
- ``rollout``: under torchrun, a 2-rank FSDP2 rollout (prompts x n samples, spread EOS): hyper_gen
  step-synced (with and without ``unshard_params``) vs the fixed-iteration no-cache workaround vs HF
  generate ``synced_gpus=True``: useful tokens/s and the time share in collectives.
- ``serve``: the HTTP server under 1 / 8 / 32 concurrent streaming clients (tokens/s, time to
  first token p50 / p99) vs the same requests as sequential ``generate`` calls and one batch.

Run: ``hyper-gen bench [loop|hf|models|tp|serve|rollout] ...`` or ``python -m hyper_gen.bench ...``.
"""

from __future__ import annotations

import argparse
import os

from .arguments import OneLineParser, backend_list, kernels_spec, non_negative, positive


def main(argv=None):
    parser = OneLineParser(
        prog="hyper-gen bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="which")
    loop = sub.add_parser("loop", help="loop time outside the forward, torch vs MindSpore")
    loop.add_argument("--backends", type=backend_list, default="torch,mindspore")
    loop.add_argument("--batch", type=positive, default=4)
    loop.add_argument("--vocab", type=positive, default=32000)
    loop.add_argument("--steps", type=positive, default=64)
    hf = sub.add_parser("hf", help="HF generate vs hyper_gen.generate on one HF Qwen3.5 model")
    hf.add_argument("--hidden", type=positive, default=256)
    hf.add_argument("--layers", type=positive, default=4)
    hf.add_argument("--vocab", type=positive, default=32000)
    hf.add_argument("--batch", type=positive, default=4)
    hf.add_argument("--prompt-len", type=positive, default=32)
    hf.add_argument("--new-tokens", type=positive, default=32)
    hf.add_argument("--repeats", type=positive, default=3)
    hf.add_argument("--threads", type=non_negative, default=0)
    models = sub.add_parser("models", help="load_model (torch, MindSpore) vs HF generate, and the roofline")
    models.add_argument("--shape", default="mid", choices=["mid", "0.8b"])
    models.add_argument(
        "--backends", type=backend_list, default="torch,mindspore", help="native backends (HF generate always runs)"
    )
    models.add_argument("--batch", type=positive, default=1)
    models.add_argument("--prompt-len", type=positive, default=32)
    models.add_argument(
        "--min-prompt-len",
        type=non_negative,
        default=0,
        help="shortest prompt: mixed lengths, left-padded (0: all equal)",
    )
    models.add_argument("--new-tokens", type=positive, default=16)
    models.add_argument("--repeats", type=positive, default=2)
    models.add_argument("--threads", type=non_negative, default=0)
    models.add_argument(
        "--kernels", type=kernels_spec, default=None, help="auto, plain or a kernel plan .json (default: auto)"
    )
    models.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "hyper_gen_bench"))
    tp = sub.add_parser("tp", help="TP=2 vs TP=1 under torchrun / msrun")
    tp.add_argument("--backend", default="torch", choices=["torch", "mindspore"])
    tp.add_argument("--shape", default="mid", choices=["mid", "0.8b"])
    tp.add_argument("--batch", type=positive, default=1)
    tp.add_argument("--prompt-len", type=positive, default=32)
    tp.add_argument("--new-tokens", type=positive, default=16)
    tp.add_argument("--repeats", type=positive, default=2)
    tp.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "hyper_gen_bench"))
    cp = sub.add_parser("cp", help="CP=2 vs CP=1 on a long prompt under torchrun / msrun, with KV bytes per rank")
    cp.add_argument("--backend", default="torch", choices=["torch", "mindspore"])
    cp.add_argument("--shape", default="mid", choices=["mid", "0.8b"])
    cp.add_argument("--batch", type=positive, default=1)
    cp.add_argument("--prompt-len", type=positive, default=2048)
    cp.add_argument("--new-tokens", type=positive, default=16)
    cp.add_argument("--repeats", type=positive, default=2)
    cp.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "hyper_gen_bench"))
    rollout = sub.add_parser("rollout", help="2-rank FSDP2 rollout: hyper_gen step-synced vs workaround vs HF")
    rollout.add_argument("--hidden", type=positive, default=256)
    rollout.add_argument("--layers", type=positive, default=4)
    rollout.add_argument("--vocab", type=positive, default=8192)
    rollout.add_argument("--prompts", type=positive, default=4, help="prompts per rank")
    rollout.add_argument("--samples", type=positive, default=4, help="samples per prompt (num_return_sequences)")
    rollout.add_argument("--prompt-len", type=positive, default=32)
    rollout.add_argument("--new-tokens", type=positive, default=64)
    rollout.add_argument("--repeats", type=positive, default=1)
    rollout.add_argument("--threads", type=positive, default=1, help="torch threads per rank")
    rollout.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    from .serve import add_parser as add_serve_parser

    add_serve_parser(sub)
    args = parser.parse_args(argv)
    if getattr(args, "min_prompt_len", 0) > getattr(args, "prompt_len", 0) and args.which == "models":
        parser.error(f"--min-prompt-len ({args.min_prompt_len}) must not exceed --prompt-len ({args.prompt_len})")
    if args.which == "serve":
        from .serve import run_serve_bench

        run_serve_bench(args)
    elif args.which == "rollout":
        from .rollout import run_rollout

        run_rollout(args)
    elif args.which == "tp":
        from .tp import run_tp

        run_tp(args)
    elif args.which == "cp":
        from .cp import run_cp

        run_cp(args)
    elif args.which == "hf":
        from .hf import run_hf

        run_hf(args)
    elif args.which == "models":
        from .models import run_models

        run_models(args)
    else:
        if args.which is None:
            args = parser.parse_args(["loop"] + list(argv or []))
        from .loop import run_loop

        run_loop(args)


if __name__ == "__main__":
    main()
