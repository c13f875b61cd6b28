"""The synthetic task the bundled demo model (``hyper_gen/demo/model``) was trained on.

Pure python (no torch / numpy): the training script (``examples/train_demo_model.py``) and the
tests share these definitions.

Task: reverse a digit string.  Prompt ``"rev 12345 ="``, completion ``" 54321"`` followed by the
tokenizer's ``<eos>``.  Digit strings have 1..MAX_DIGITS digits (leading zeros allowed).

Held-out split: a digit string of length >= 2 is *held out* when ``crc32(digits) % HELDOUT_MOD == 0``.
Training never samples held-out strings and ``make_prompts`` only returns held-out strings, so the
evaluation prompts are disjoint from training whatever seeds either side uses.  (The only
1-digit prompts, "rev 0 =" .. "rev 9 =", are all training prompts.)
"""

from __future__ import annotations

import random
import zlib
from typing import List, Tuple

OP = "rev"
MIN_DIGITS = 1
MAX_DIGITS = 8
HELDOUT_MOD = 8  # 1/8 of the digit strings of length >= 2 are held out

# every character a prompt or completion can contain (the tokenizer's character vocabulary is a superset)
CHARS = "0123456789 =" + OP


def prompt_for(digits: str) -> str:
    return f"{OP} {digits} ="


def answer_for(digits: str) -> str:
    """The expected completion text (without the end-of-sequence token)."""
    return " " + digits[::-1]


def is_heldout(digits: str) -> bool:
    return len(digits) >= 2 and zlib.crc32(digits.encode("ascii")) % HELDOUT_MOD == 0


def _random_digits(rng: random.Random, min_digits: int, max_digits: int) -> str:
    n = rng.randint(min_digits, max_digits)
    return "".join(rng.choice("0123456789") for _ in range(n))


def sample_training_example(rng: random.Random) -> Tuple[str, str]:
    """One (prompt, completion) pair from the training split."""
    while True:
        digits = _random_digits(rng, MIN_DIGITS, MAX_DIGITS)
        if not is_heldout(digits):
            return prompt_for(digits), answer_for(digits)


def make_prompts(n: int, seed: int = 0, min_digits: int = 2, max_digits: int = MAX_DIGITS) -> List[Tuple[str, str]]:
    """``n`` held-out (prompt_text, expected_completion_text) pairs, deterministic in ``seed``.

    The completion text excludes the end-of-sequence token; prompts are never seen in training.
    """
    if min_digits < 2:
        raise ValueError("held-out prompts have at least 2 digits (all 1-digit prompts are training prompts)")
    rng = random.Random(f"hyper_gen-demo-heldout-{seed}")
    out = []
    while len(out) < n:
        digits = _random_digits(rng, min_digits, max_digits)
        if is_heldout(digits):
            out.append((prompt_for(digits), answer_for(digits)))
    return out


def parse_prompt(prompt: str) -> str:
    """The digit string of a ``"rev DIGITS ="`` prompt (ValueError if the prompt is not one)."""
    text = prompt.strip()
    head, sep, rest = text.partition(" ")
    if head != OP or not sep or not rest.endswith("="):
        raise ValueError(f"not a demo-task prompt: {prompt!r}")
    digits = rest[:-1].strip()
    if not digits.isdigit() or not digits.isascii():
        raise ValueError(f"not a demo-task prompt: {prompt!r}")
    return digits


def is_correct(prompt: str, completion_text: str) -> bool:
    """Whether ``completion_text`` (decoded generated text, special tokens skipped or not)
    answers ``prompt``.  Surrounding whitespace is ignored; anything after an ``<eos>`` is ignored."""
    digits = parse_prompt(prompt)
    completion_text = completion_text.split("<eos>", 1)[0]
    return completion_text.strip() == digits[::-1]
