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
- ``router``: N ``serve`` workers behind sglang-router, ``cache_aware`` vs ``round_robin`` on GRPO
  groups (prompts x samples): prefix-cache hit rate summed over the workers, tokens/s; with one
  worker, the router's overhead per request against a direct call.
- ``offline``: a JSONL job with in-flight batching vs fixed micro-batches, on mixed output lengths.
- ``update``: ``update_weights`` with every tensor of a checkpoint vs ``load_model`` of it.
- ``logprobs``: float32 rollout logprobs vs ``score()`` of the same tokens, against a float64 reference.
- ``invariance``: batch-invariant mode vs default: decode tokens/s at batch 1 and 16, prefill, and
  the rollout-vs-``score()`` logprob gap in each mode (torch).
- ``engine``: the paged engine: prefix caching on vs off, peak cache bytes vs live tokens, running
  rows' latency while a long prompt is prefilled in chunks, a GRPO group vs generate and HF, what
  paging costs a decode step, a long-context decode step vs generate's static cache, a mixed
  workload's tokens/s, and output processing per token; ``--baseline PATH`` runs each scenario from
  another checkout too and prints the two side by side.
- ``rl``: the RL server: ``/update_weights_from_distributed`` over gloo vs a bare broadcast of the same
  tensors (HTTP, broadcast and apply apart), and ``/generate`` vs ``/v1/completions`` on the same
  token-id requests.
- ``text``: the engine's output processing (incremental detokenization, stop strings) per generated
  token at 256 and 16,384 tokens: a cost that grows with the output would show as a ratio above 1.

Run: ``hyper-gen bench [loop|hf|models|tp|cp|rollout|serve|router|offline|update|logprobs|invariance|engine|rl|text]
...`` (``loop`` when none is named) or ``python -m hyper_gen.bench ...``; ``hyper-gen bench <command>
--help`` explains every flag with its default. MindSpore's and transformers' own logs are errors
only (``GLOG_v=3``, unless set), as in the rest of the CLI; ``-v`` shows them.
"""

from __future__ import annotations

import sys

from hyper_gen.jobs.errors import UsageError
from hyper_gen.jobs.logs import quiet_framework_logs

from .arguments import (
    CACHE_DIR,
    HelpFormatter,
    OneLineParser,
    add_command,
    backend_list,
    kernels_spec,
    non_negative,
    positive,
)


def _shape_flags(parser, prompt_len: int, cache_dir: bool = True) -> None:
    """The flags of the benches that run a random-weight Qwen3.5 checkpoint of a named shape."""
    parser.add_argument(
        "--shape", default="mid", choices=["mid", "0.8b"], help="checkpoint shape: mid (hidden 512, 8 layers) or 0.8b"
    )
    parser.add_argument("--batch", type=positive, default=1, help="prompts decoded together")
    parser.add_argument("--prompt-len", type=positive, default=prompt_len, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=positive, default=16, help="tokens generated per row")
    parser.add_argument("--repeats", type=positive, default=2, help="timed runs; the fastest is kept")
    if cache_dir:
        parser.add_argument(
            "--cache-dir", default=CACHE_DIR, help="where the random-weight checkpoint is written once and reused"
        )


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="hyper-gen bench", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="which", metavar="command")
    loop = add_command(sub, "loop", "per-step loop cost outside the forward, per backend")
    loop.add_argument(
        "--backends", type=backend_list, default="torch,mindspore", help="comma-separated backends, side by side"
    )
    loop.add_argument("--batch", type=positive, default=4, help="rows per step")
    loop.add_argument("--vocab", type=positive, default=32000, help="vocabulary size (the logits' width)")
    loop.add_argument("--steps", type=positive, default=64, help="decode steps timed per setting")
    hf = add_command(sub, "hf", "HF generate vs hyper_gen on one HF Qwen3.5 model")
    hf.add_argument("--hidden", type=positive, default=256, help="hidden size of the random-weight model")
    hf.add_argument("--layers", type=positive, default=4, help="decoder layers")
    hf.add_argument("--vocab", type=positive, default=32000, help="vocabulary size")
    hf.add_argument("--batch", type=positive, default=4, help="prompts decoded together")
    hf.add_argument("--prompt-len", type=positive, default=32, help="prompt tokens per row")
    hf.add_argument("--new-tokens", type=positive, default=32, help="tokens generated per row")
    hf.add_argument("--repeats", type=positive, default=3, help="timed runs; the fastest is kept")
    hf.add_argument("--threads", type=non_negative, default=0, help="torch threads (0: torch's default)")
    models = add_command(sub, "models", "native torch / MindSpore vs HF generate, and the roofline")
    _shape_flags(models, prompt_len=32, cache_dir=False)
    models.add_argument(
        "--backends", type=backend_list, default="torch,mindspore", help="native backends (HF generate always runs)"
    )
    models.add_argument(
        "--min-prompt-len",
        type=non_negative,
        default=0,
        help="shortest prompt: mixed lengths up to --prompt-len, left-padded (0: all equal)",
    )
    models.add_argument("--threads", type=non_negative, default=0, help="torch threads (0: torch's default)")
    models.add_argument(
        "--kernels",
        type=kernels_spec,
        default=None,
        help="auto, plain or a kernel plan .json (default: $HYPER_GEN_KERNELS, else auto)",
    )
    models.add_argument(
        "--cache-dir", default=CACHE_DIR, help="where the random-weight checkpoint is written once and reused"
    )
    tp = add_command(sub, "tp", "TP=2 vs TP=1 under torchrun / msrun")
    tp.add_argument("--backend", default="torch", choices=["torch", "mindspore"], help="the framework timed")
    _shape_flags(tp, prompt_len=32)
    cp = add_command(sub, "cp", "CP=2 vs CP=1 on a long prompt under torchrun / msrun")
    cp.add_argument("--backend", default="torch", choices=["torch", "mindspore"], help="the framework timed")
    _shape_flags(cp, prompt_len=2048)
    rollout = add_command(sub, "rollout", "2-rank FSDP2 rollout vs the no-cache workaround and HF")
    rollout.add_argument("--hidden", type=positive, default=256, help="hidden size of the random-weight model")
    rollout.add_argument("--layers", type=positive, default=4, help="decoder layers")
    rollout.add_argument("--vocab", type=positive, default=8192, help="vocabulary size")
    rollout.add_argument("--prompts", type=positive, default=4, help="prompts per rank")
    rollout.add_argument("--samples", type=positive, default=4, help="samples per prompt (num_return_sequences)")
    rollout.add_argument("--prompt-len", type=positive, default=32, help="prompt tokens per row")
    rollout.add_argument("--new-tokens", type=positive, default=64, help="the cap on tokens per row")
    rollout.add_argument("--repeats", type=positive, default=1, help="timed runs; the fastest is kept")
    rollout.add_argument("--threads", type=positive, default=1, help="torch threads per rank")
    rollout.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    from .engine import add_parser as add_engine_parser
    from .invariance import add_parser as add_invariance_parser
    from .logprobs import add_parser as add_logprobs_parser
    from .offline import add_parser as add_offline_parser
    from .rl_server import add_parser as add_rl_parser
    from .router import add_parser as add_router_parser
    from .serve import add_parser as add_serve_parser
    from .text import add_parser as add_text_parser
    from .update import add_parser as add_update_parser

    add_serve_parser(sub)
    add_router_parser(sub)
    add_offline_parser(sub)
    add_update_parser(sub)
    add_logprobs_parser(sub)
    add_invariance_parser(sub)
    add_engine_parser(sub)
    add_rl_parser(sub)
    add_text_parser(sub)
    return parser


def main(argv=None) -> int:
    """Run one bench; 2 (after one line on stderr) for a problem the user can fix, as in the rest of
    the CLI: a bench that needs a launcher started without one, a bad --tokenizer, a --context too long."""
    try:
        _run(argv)
    except UsageError as exc:
        print(f"hyper-gen bench: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run(argv=None) -> None:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.which is None:  # the default command
        args = parser.parse_args(["loop"] + argv)
    if not args.verbose:
        quiet_framework_logs()  # before the command imports a framework (MindSpore reads it then)
    if getattr(args, "min_prompt_len", 0) > getattr(args, "prompt_len", 0) and args.which == "models":
        parser.error(f"--min-prompt-len ({args.min_prompt_len}) must not exceed --prompt-len ({args.prompt_len})")
    if args.which == "text":
        from .text import run_text

        run_text(args)
    elif args.which == "engine":
        from .engine import run_engine

        run_engine(args)
    elif args.which == "rl":
        from .rl_server import run_rl

        run_rl(args)
    elif args.which == "serve":
        from .serve import run_serve_bench

        run_serve_bench(args)
    elif args.which == "router":
        from .router import run_router_bench

        run_router_bench(args)
    elif args.which == "invariance":
        from .invariance import run_invariance

        run_invariance(args)
    elif args.which == "logprobs":
        from .logprobs import run_logprobs

        run_logprobs(args)
    elif args.which == "update":
        from .update import run_update

        run_update(args)
    elif args.which == "offline":
        from .offline import run_offline

        run_offline(args)
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
        from .loop import run_loop

        run_loop(args)


if __name__ == "__main__":
    sys.exit(main())
