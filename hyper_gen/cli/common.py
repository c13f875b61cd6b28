"""What the ``hyper-gen`` subcommands share: the user-error type, model and sampling flags, and
loading a model with its tokenizer. Subcommands import this module; nothing here imports them.
"""

from __future__ import annotations

import os

from hyper_gen import registry
from hyper_gen.config import GenerationConfig
from hyper_gen.demo import demo_model_path
from hyper_gen.generation import generate
from hyper_gen.parallel.launcher import host_ops, init_distributed, launched_multi_rank
from hyper_gen.registry import to_host


class UsageError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def add_model_flags(parser):
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: the bundled demo model)")
    parser.add_argument("--backend", default="torch", help="torch | mindspore (default torch)")
    parser.add_argument("--dtype", default="float32", help="float32 | float64 | float16 | bfloat16")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (under torchrun / msrun)")


def add_sampling_flags(parser):
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="portable seeded sampling (same tokens everywhere)")


def generation_config(args, defaults: dict) -> GenerationConfig:
    """The config the flags ask for, with the checkpoint's eos/pad ids; rejected values -> UsageError."""
    try:
        return GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            eos_token_id=defaults.get("eos_token_id"),
            pad_token_id=defaults.get("pad_token_id", 0),
        )
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def load_tokenizer(path: str):
    if not any(
        os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise UsageError(f"model path {path!r} has no tokenizer (tokenizer.json)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return tokenizer


def load_everything(args):
    """(model, tokenizer, token-id defaults) for the flags; errors a user can fix -> UsageError."""
    if args.backend not in registry.names():
        raise UsageError(f"unknown backend {args.backend!r}; choose one of {', '.join(registry.names())}")
    path = args.model or demo_model_path()
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"model path {path!r} is not an HF checkpoint folder (no config.json)")
    tokenizer = load_tokenizer(path)
    from hyper_gen.models.loading import load_model

    if args.tp > 1 or launched_multi_rank():
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


def rank(backend: str) -> int:
    """This process's rank (0 outside a multi-rank job)."""
    return host_ops(backend).rank() if launched_multi_rank() else 0


def host(tensor):
    """A framework tensor (generate's output) as a numpy array."""
    import numpy as np

    return np.asarray(to_host(tensor))


def completions(model, tokenizer, prompts, config, on_tokens=None):
    """(completion texts, generated token counts, finish reasons) for a left-padded batch of prompts."""
    batch = tokenizer(prompts, padding=True, return_tensors="np", add_special_tokens=False)
    mask = batch["attention_mask"]
    out = host(generate(model, batch["input_ids"], config, attention_mask=mask, on_tokens=on_tokens))
    texts, counts, reasons = [], [], []
    eos = set(config.eos_token_ids)
    for row, length in enumerate(mask.sum(axis=1)):
        generated = out[row, int(length) :].tolist()
        ended = next((i for i, t in enumerate(generated) if t in eos), None)
        generated = generated[: ended + 1] if ended is not None else generated
        if ended is None:  # trailing pad ids only pad the output to the common width
            generated = generated[: config.max_new_tokens]
        texts.append(tokenizer.decode(generated, skip_special_tokens=True))
        counts.append(len(generated))
        reasons.append("eos" if ended is not None else "length")
    return texts, counts, reasons
