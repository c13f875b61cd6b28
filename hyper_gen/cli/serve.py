"""``hyper-gen serve``: the OpenAI-compatible HTTP server on the in-flight batching engine.

The port is bound before the model loads (a port in use is a one-line error, exit 2, at once).
Under torchrun / msrun rank 0 listens and every other rank follows rank 0's engine steps; all
ranks exit 0 when rank 0 is stopped (SIGINT / SIGTERM).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from hyper_gen.engine import Engine, EngineConfig
from hyper_gen.jobs.errors import UsageError
from hyper_gen.parallel.launcher import launched_multi_rank

from .common import add_model_flags, load_everything, model_path, rank

DEMO_NAME = "hyper_gen-demo"


def add_serve_flags(parser) -> None:
    add_model_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on; 0 = any free one (default: %(default)s)"
    )
    parser.add_argument(
        "--max-batch-size",
        "--max-num-seqs",  # vLLM's name
        type=int,
        default=32,
        help="requests decoded together at most (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + completion tokens at most (default: the model's context)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV blocks of common prompt prefixes between requests (default: on)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="positions per KV cache block (default: 16)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens a step computes at most; longer prompts are prefilled in chunks (default: %(default)s)",
    )
    parser.add_argument(
        "--cache-memory-bytes",
        "--kv-cache-memory-bytes",  # vLLM's name
        type=int,
        default=None,
        help="the KV cache pool's bytes (default: what --max-batch-size rows of --max-model-len could use, "
        "within a quarter of the available memory)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=("hermes", "qwen3_coder"),
        help="how tool calls are read from the output (vLLM's names; default: %(default)s, Qwen's <tool_call>{json})",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=("qwen3", "deepseek_r1"),
        help="split <think>...</think> into reasoning_content (vLLM's names; default: off)",
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no access log (by default each request's method, path, status and time go to stderr)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help=f"the name clients pass as 'model' (default: the --model value, or {DEMO_NAME!r})",
    )


def _check_flags(args) -> None:
    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"hyper-gen serve needs {' and '.join(missing)}: pip install 'hyper_gen[serve]'")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch_size < 1:
        raise UsageError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UsageError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    for flag in ("block_size", "max_num_batched_tokens", "cache_memory_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name must not be empty")


def _bind(args):
    from hyper_gen.server.launch import bind  # here: fastapi / uvicorn are optional (checked by _check_flags)

    try:
        return bind(args.host, args.port)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None


def run_serve(args) -> int:
    _check_flags(args)
    # one process: bound before the model loads, so a taken port fails at once; a multi-rank job
    # knows which rank is 0 once it has joined (load_everything)
    sock = None if launched_multi_rank() else _bind(args)
    try:
        model, tokenizer, _ = load_everything(args)
        if sock is None and rank(args.backend) == 0:
            sock = _bind(args)
        from hyper_gen.server.launch import follow, serve  # here: fastapi / uvicorn are optional
        from hyper_gen.server.metrics import kv_cache_line

        try:
            config = EngineConfig(
                max_num_seqs=args.max_batch_size,
                max_model_len=args.max_model_len,
                enable_prefix_caching=args.enable_prefix_caching,
                block_size=args.block_size,
                max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory_bytes=args.cache_memory_bytes,
            )
            engine = Engine(model, tokenizer, config=config)
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from None
        if rank(args.backend) != 0:
            follow(engine)
            return 0
        engine.start()
        name = args.served_model_name or args.model or DEMO_NAME
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host

        def started():
            cache = kv_cache_line(engine.stats())
            if cache is not None:
                print(f"hyper-gen serve: {cache}", file=sys.stderr, flush=True)
            print(
                f"hyper-gen serve: http://{shown}:{port}/v1 serving {name!r} ({args.backend}, tp {args.tp}, "
                f"max batch {args.max_batch_size}); Ctrl-C stops",
                file=sys.stderr,
                flush=True,
            )

        serve(
            engine,
            tokenizer,
            name,
            sock,
            log_level="info" if args.verbose else "warning",
            on_started=started,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            access_log=not args.quiet,
            model_path=os.path.abspath(model_path(args)),
            tp_size=args.tp,
            backend=args.backend,
        )
        print("hyper-gen serve: stopped", file=sys.stderr, flush=True)
        return 0
    finally:
        if sock is not None:
            sock.close()
