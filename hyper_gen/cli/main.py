"""``hyper-gen``: generate, chat and bench from the command line (also ``python -m hyper_gen``).

Errors a user can fix (unknown backend, a path that is not a checkpoint, a missing tokenizer, a
rejected flag) print one line and exit with status 2.
"""

from __future__ import annotations

import signal
import sys
import threading

from hyper_gen import __version__, registry
from hyper_gen.bench import main as bench_main
from hyper_gen.bench.arguments import OneLineParser
from hyper_gen.jobs.errors import Interrupted, UsageError
from hyper_gen.jobs.logs import quiet_framework_logs
from hyper_gen.parallel.launcher import launched_multi_rank, shutdown_distributed

from .chat import run_chat
from .common import add_model_flags, add_sampling_flags
from .generate import run_generate
from .serve import add_serve_flags, run_serve


def build_parser() -> OneLineParser:
    # usage errors are one line, exit 2, in every subcommand (the subparsers are of the same class)
    parser = OneLineParser(prog="hyper-gen", description="One generate() for PyTorch and MindSpore models.")
    parser.add_argument("--version", action="version", version=f"hyper-gen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts, or a JSONL file of prompts")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--input", help='JSONL file with {"id": ..., "prompt": ...} per line')
    gen.add_argument("--output", help="JSONL file to append results to (resumable)")
    gen.add_argument("--batch-size", type=int, default=8, help="rows decoded together (default: %(default)s)")
    gen.add_argument(
        "--batching",
        choices=("inflight", "fixed"),
        default="inflight",
        help="JSONL jobs: refill finished rows at every step (inflight, default) or run fixed micro-batches",
    )
    gen.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    add_model_flags(gen, batch_invariant=True)
    add_sampling_flags(gen)
    chat = sub.add_parser("chat", help="interactive streaming chat (rank 0 reads stdin)")
    add_model_flags(chat)
    add_sampling_flags(chat, max_new_tokens=128)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_serve_flags(serve)
    sub.add_parser("bench", help="benchmarks against HF generate and the roofline", add_help=False)
    return parser


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_cleanly_on_sigterm() -> bool:
    """A single-process generate / chat job stops on SIGTERM as on Ctrl-C (exit 130, one line,
    every finished row kept). MindSpore's graph runtime answers Ctrl-C by sending the process
    SIGTERM, so without this a MindSpore job could die mid-row (exit -15); a user's own SIGTERM
    handler, multi-rank jobs (the launcher stops their ranks) and the server are left alone.
    True when it installed the handler (``main`` restores the default when the job ends)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        return True
    return False


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if not args.verbose:
        quiet_framework_logs()
    sigterm_handled = args.command in ("generate", "chat") and not launched_multi_rank() and stop_cleanly_on_sigterm()
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        return run_chat(args)
    except UsageError as exc:
        print(f"hyper-gen: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"hyper-gen: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 130
    finally:
        if sigterm_handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if launched_multi_rank() and args.backend in registry.names():
            shutdown_distributed(args.backend)  # every rank leaves the job cleanly


def entry_point() -> None:
    sys.exit(main())
