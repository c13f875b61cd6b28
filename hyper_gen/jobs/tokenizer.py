"""The checkpoint's HF tokenizer, checked and loaded the one way every product part needs it:
left padding (generate's batches), and a missing file as a UsageError, not a transformers traceback."""

from __future__ import annotations

import os

from .errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_tokenizer_files(path: str) -> None:
    """The tokenizer files, checked before any weight is read (the tokenizer loads after the model)."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise UsageError(f"model path {path!r} has no tokenizer (tokenizer.json)")
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        raise UsageError(
            f"model path {path!r} has no tokenizer_config.json: without it the special tokens, padding side "
            "and chat template are unknown and the output would silently change"
        )


def load_tokenizer(path: str):
    check_tokenizer_files(path)
    from transformers import AutoTokenizer  # here: keeps transformers out of `import hyper_gen`

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"cannot load the tokenizer in {path!r}: {str(exc).splitlines()[0]}") from None
    tokenizer.padding_side = "left"
    return tokenizer
