"""``hyper-gen``: generate, chat and bench from the command line (also ``python -m hyper_gen``).

Errors a user can fix (unknown backend, a path that is not a checkpoint, a missing tokenizer, a
rejected flag) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources

from .config import GenerationConfig

BACKENDS = ("torch", "mindspore")


class UsageError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def demo_model_path() -> str:
    return str(resources.files("hyper_gen") / "demo_model")


def _add_model_flags(parser):
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: the bundled demo model)")
    parser.add_argument("--backend", default="torch", help="torch | mindspore (default torch)")
    parser.add_argument("--dtype", default="float32", help="float32 | float64 | float16 | bfloat16")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (under torchrun / msrun)")


def _add_sampling_flags(parser):
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="portable seeded sampling (same tokens everywhere)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyper-gen", description="One generate() for PyTorch and MindSpore models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts, or a JSONL file of prompts")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--input", help="JSONL file with {\"id\": ..., \"prompt\": ...} per line")
    gen.add_argument("--output", help="JSONL file to append results to (resumable)")
    gen.add_argument("--batch-size", type=int, default=8)
    gen.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    _add_model_flags(gen)
    _add_sampling_flags(gen)
    chat = sub.add_parser("chat", help="interactive streaming chat (rank 0 reads stdin)")
    _add_model_flags(chat)
    _add_sampling_flags(chat)
    chat.set_defaults(max_new_tokens=128)
    sub.add_parser("bench", help="benchmarks against HF generate and the roofline", add_help=False)
    return parser


def generation_config(args, defaults: dict) -> GenerationConfig:
    """The config the flags ask for, with the checkpoint's eos/pad ids; rejected values -> UsageError."""
    try:
        return GenerationConfig(
            max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            seed=args.seed, eos_token_id=defaults.get("eos_token_id"), pad_token_id=defaults.get("pad_token_id", 0),
        )
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def load_tokenizer(path: str):
    if not any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer.model",
                                                                        "vocab.json")):
        raise UsageError(f"model path {path!r} has no tokenizer (tokenizer.json)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return tokenizer


def load_everything(args):
    """(model, tokenizer, token-id defaults) for the flags; errors a user can fix -> UsageError."""
    if args.backend not in BACKENDS:
        raise UsageError(f"unknown backend {args.backend!r}; choose one of {', '.join(BACKENDS)}")
    path = args.model or demo_model_path()
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"model path {path!r} is not an HF checkpoint folder (no config.json)")
    tokenizer = load_tokenizer(path)
    from .distributed import init_distributed
    from .loading import load_model

    if args.tp > 1 or _launched_multi_rank():
        init_distributed(args.backend)
    try:
        kwargs = {"tp": args.tp} if args.tp > 1 else {}
        model = load_model(path, backend=args.backend, dtype=args.dtype, **kwargs)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    defaults = dict(getattr(model, "generation_defaults", {}) or {})
    if defaults.get("eos_token_id") is None and tokenizer.eos_token_id is not None:
        defaults["eos_token_id"] = tokenizer.eos_token_id
    if defaults.get("pad_token_id") is None:
        defaults["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return model, tokenizer, defaults


def _launched_multi_rank() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("MS_WORKER_NUM", "1")) > 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from .bench import main as bench_main

        bench_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            from .cli_generate import run_generate

            return run_generate(args)
        from .chat import run_chat

        return run_chat(args)
    except UsageError as exc:
        print(f"hyper-gen: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if _launched_multi_rank() and args.backend in BACKENDS:
            from .distributed import shutdown_distributed

            shutdown_distributed(args.backend)  # every rank leaves the job cleanly


def entry_point() -> None:
    sys.exit(main())
