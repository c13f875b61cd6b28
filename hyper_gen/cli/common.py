"""What the ``hyper-gen`` subcommands share: model and sampling flags, and loading a model with its
tokenizer. Subcommands import this module; nothing here imports them. What the benchmarks and the
server share with the CLI (user errors, the tokenizer, the JSONL runner) is in ``hyper_gen.jobs``.
"""

from __future__ import annotations

import os
import sys

from hyper_gen import registry
from hyper_gen.config import GenerationConfig, model_defaults
from hyper_gen.demo import demo_model_path
from hyper_gen.jobs.errors import UsageError
from hyper_gen.jobs.tokenizer import check_tokenizer_files, load_tokenizer
from hyper_gen.models.checkpoint import folder_problem
from hyper_gen.models.loading import load_model
from hyper_gen.parallel.launcher import (
    TIMEOUT_ENV,
    broadcast_ints,
    collective_timeout_s,
    host_ops,
    init_distributed,
    launched_multi_rank,
    shutdown_distributed,
)


def add_model_flags(parser, batch_invariant: bool = False):
    """The model flags; ``batch_invariant``: also ``--batch-invariant`` (where the command runs the
    model through generate(), whose batch-invariant mode the engine does not serve yet)."""
    parser.add_argument("--model", default=None, help="local HF checkpoint folder (default: the bundled demo model)")
    if batch_invariant:
        parser.add_argument(
            "--batch-invariant",
            action="store_true",
            help="load the model in batch-invariant mode: each prompt's tokens and logprobs are the same bits "
            "alone or in any batch (torch native Qwen3.5, tp = cp = 1; slower)",
        )
    parser.add_argument("--backend", default="torch", help="torch | mindspore (default: %(default)s)")
    parser.add_argument(
        "--dtype", default="float32", help="float32 | float64 | float16 | bfloat16 (default: %(default)s)"
    )
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks, under torchrun / msrun (default: %(default)s)"
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks (the prompt split along the sequence), under torchrun / msrun; the job "
        "has tp * cp ranks (default: %(default)s)",
    )
    parser.add_argument(
        "--cp-strategy",
        default="allgather",
        choices=("allgather", "ulysses"),
        help="how full-attention layers exchange a --cp prefill: allgather K|V, or ulysses all-to-all of the "
        "heads (torch only) (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"under torchrun / msrun: how long a rank waits for a stalled or dead peer before the job fails "
        f"(default: ${TIMEOUT_ENV}, else 600 s on torch, 30 s on MindSpore's CPU collectives)",
    )
    parser.add_argument(
        "--shard",
        default="none",
        choices=("none",) + tuple(dict.fromkeys(s for b in registry.BACKENDS.values() for s in b.sharders)),
        help="under torchrun: load --model with transformers and shard every decoder layer and the root over all "
        "ranks, with torch's FSDP2 or HyperParallel's fully_shard (chat, generate; torch) (default: %(default)s)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the frameworks' own log messages")


def add_sampling_flags(parser, max_new_tokens: int = 64):
    parser.add_argument(
        "--max-new-tokens", type=int, default=max_new_tokens, help="tokens to generate at most (default: %(default)s)"
    )
    parser.add_argument(
        "--do-sample", action="store_true", help="sample (implied by --temperature > 0, --top-k, --top-p, --min-p)"
    )
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 1.0 when sampling)")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: 50)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: 1.0)")
    parser.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top (default: 0)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="HF's penalty (default: 1.0)")
    parser.add_argument(
        "--seed", type=int, default=None, help="portable seeded sampling: the same tokens on every backend"
    )


# flag -> GenerationConfig field; any of these given implies sampling, as vLLM users expect
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p"}


def generation_config(args, defaults: dict) -> GenerationConfig:
    """The config the flags ask for, with the checkpoint's eos/pad ids; rejected values -> UsageError.

    ``--temperature 0`` is greedy; any other sampling flag samples (``--do-sample`` is implied)."""
    values = {"max_new_tokens": args.max_new_tokens, "seed": args.seed}
    for name in ("eos_token_id", "pad_token_id"):
        values[name] = defaults.get(name)
    values["pad_token_id"] = values["pad_token_id"] if values["pad_token_id"] is not None else 0
    if args.repetition_penalty is not None:
        values["repetition_penalty"] = args.repetition_penalty
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if given.get("temperature") is not None and given["temperature"] < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {given['temperature']}")
    greedy = given.get("temperature") == 0
    if greedy:
        del given["temperature"]
    values.update(given)
    values["do_sample"] = not greedy and (args.do_sample or bool(given))
    try:
        return GenerationConfig(**values)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def model_path(args) -> str:
    """The checkpoint folder the flags name, checked before anything is loaded (load_model's words)."""
    path = demo_model_path() if args.model is None else args.model  # --model "" is a path, not the default
    problem = folder_problem(path, "pass --model DIR")
    if problem is not None:
        raise UsageError(problem)
    return path


def load_everything(args):
    """(model, tokenizer, token-id defaults) for the flags; errors a user can fix -> UsageError.

    The model loads before the tokenizer, so a clear load_model error is never hidden behind a
    tokenizer traceback; the tokenizer files are checked first all the same (cheap)."""
    if args.backend not in registry.names():
        raise UsageError(f"unknown backend {args.backend!r}; choose one of {', '.join(registry.names())}")
    if args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    cp = getattr(args, "cp", 1)
    if cp < 1:
        raise UsageError(f"--cp must be >= 1, got {cp}")
    shard = getattr(args, "shard", "none")
    invariant = getattr(args, "batch_invariant", False)
    if shard != "none":
        _check_shard(args, shard, cp)
        if invariant:
            raise UsageError("--batch-invariant loads the native model; it does not combine with --shard")
    try:
        timeout_s = collective_timeout_s(getattr(args, "timeout", None))
    except ValueError as exc:
        raise UsageError(str(exc).replace("timeout_s", "--timeout", 1)) from None
    path = model_path(args)
    check_tokenizer_files(path)
    if args.tp > 1 or cp > 1 or launched_multi_rank():
        init_distributed(args.backend, timeout_s=timeout_s)
    try:
        if shard != "none":
            model = registry.adapter(args.backend).load_sharded(path, args.dtype, shard)
        else:
            model = load_model(
                path,
                backend=args.backend,
                dtype=args.dtype,
                tp=args.tp,
                cp=cp,
                cp_strategy=getattr(args, "cp_strategy", "allgather"),
                **({"batch_invariant": True} if invariant else {}),
            )
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    tokenizer = load_tokenizer(path)
    defaults = dict(getattr(model, "generation_defaults", None) or model_defaults(model))
    if defaults.get("eos_token_id") is None and tokenizer.eos_token_id is not None:
        defaults["eos_token_id"] = tokenizer.eos_token_id
    if defaults.get("pad_token_id") is None:
        defaults["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return model, tokenizer, defaults


def _check_shard(args, shard: str, cp: int) -> None:
    """UsageError unless ``--shard`` can shard this job: a backend with that sharder, no --tp / --cp, a
    multi-rank job, and chat or generate."""
    able = [b.name for b in registry.BACKENDS.values() if shard in b.sharders]
    if args.backend not in able:
        raise UsageError(f"--shard {shard} needs --backend {' or '.join(able)}, not {args.backend}")
    if args.tp > 1 or cp > 1:
        raise UsageError(f"--shard {shard} shards the whole model over all ranks: it does not combine with --tp / --cp")
    if getattr(args, "command", None) == "serve":
        raise UsageError(f"--shard {shard} is for chat and generate, not serve")
    if not launched_multi_rank():
        launcher = registry.adapter(args.backend).launcher(2)
        raise UsageError(f"--shard {shard} shards the model over the ranks of a job: run it under {launcher} or more")


def end_sharded_job(args, code: int) -> int:
    """``code``; in a ``--shard`` job, this rank exits with it once every rank is here, leaving the group
    and skipping the interpreter's teardown, as hyper_gen/bench/rollout.py does: gloo threads still
    holding FSDP's async work can abort a rank at finalization (SIGABRT, pytorch/pytorch#179291). The
    caller drops its model first (FSDP's state holds the mesh's group)."""
    if getattr(args, "shard", "none") == "none" or not launched_multi_rank():
        return code
    broadcast_ints(host_ops(args.backend), [code])  # every rank done with the group before it goes
    shutdown_distributed(args.backend)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank(backend: str) -> int:
    """This process's rank (0 outside a multi-rank job)."""
    return host_ops(backend).rank() if launched_multi_rank() else 0
