"""``stop_strings`` with HF's semantics, on the host.

HF's ``StopStringCriteria`` ends a row when a stop string appears in the text of the row's tokens
(prompt included) *overlapping its last token*: "stop" matches ["st", "op"], ["st", "opera"] or
["las", "topper"], but not ["stop", "at"], so a string already in the prompt never stops a row at
a later step. Each token's text is its text in context (the tokenizer's
``convert_tokens_to_string`` after a fixed prefix, as HF cleans its vocabulary), so byte-level
markers such as ``Ġ`` count as the space they stand for. HF matches with precomputed tensors so
the check compiles; here each step looks only at the few tokens that can reach back over the
longest stop string, in plain Python.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

_PREFIX = "abcdef"  # a context every tokenizer splits plainly, so a token's own text follows it


class StopStrings:
    """Per-row matcher; ``check(tokens)`` after every step says which rows completed a stop string."""

    def __init__(self, stop_strings: Sequence[str], tokenizer, prompt):
        if tokenizer is None:
            raise ValueError(
                f"stop_strings={list(stop_strings)!r} needs the tokenizer to read tokens as text: pass "
                "generate(..., tokenizer=tokenizer), as HF does"
            )
        for name in ("convert_ids_to_tokens", "convert_tokens_to_string"):
            if not callable(getattr(tokenizer, name, None)):
                raise TypeError(f"tokenizer must be an HF tokenizer (with {name}), got {type(tokenizer).__name__}")
        self.stop_strings = list(stop_strings)
        self.longest = max(len(s) for s in self.stop_strings)
        self.tokenizer = tokenizer
        base_ids = tokenizer(_PREFIX, add_special_tokens=False)["input_ids"]
        self._base = tokenizer.convert_ids_to_tokens(list(base_ids))
        self._text: Dict[int, str] = {}
        self.rows: List[List[str]] = [
            [self.token_text(int(t)) for t in prompt.real_tokens(r)] for r in range(prompt.batch_size)
        ]

    def token_text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            joined = self.tokenizer.convert_tokens_to_string(self._base + [token]) if token is not None else _PREFIX
            at = joined.find(_PREFIX)
            text = joined[at + len(_PREFIX) :] if at >= 0 else joined
            self._text[token_id] = text
        return text

    def check(self, tokens: np.ndarray, running: np.ndarray) -> np.ndarray:
        """Append each running row's token; (B,) True where a stop string now overlaps the last token."""
        stop = np.zeros(len(tokens), dtype=bool)
        for row in np.flatnonzero(running):
            texts = self.rows[row]
            texts.append(self.token_text(int(tokens[row])))
            last = len(texts[-1])
            tail, need = [], last + self.longest - 1
            for piece in reversed(texts):
                tail.append(piece)
                need -= len(piece)
                if need <= 0:
                    break
            text = "".join(reversed(tail))
            if len(texts) > 4 * len(tail) + 64:  # keep only what a match can reach
                del texts[: len(texts) - len(tail)]
            for s in self.stop_strings:
                if text.find(s, max(0, len(text) - last - len(s) + 1)) >= 0:
                    stop[row] = True
                    break
        return stop
