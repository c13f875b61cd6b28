"""Incremental text for one choice: stable deltas, and stop strings with OpenAI / vLLM semantics.

Each step decodes the choice's ids so far (``tokenizer.decode(ids, skip_special_tokens=True)``)
and emits what is new past the text already emitted. Two things are held back: a trailing
U+FFFD (a multi-byte character whose bytes have not all arrived; emitting it would break the
character for good), and, when the request has stop strings, the last ``len(longest stop) - 1``
characters (they could still turn out to be the start of a stop string, which must never reach
the client). When a stop string appears, the choice ends and its text is everything before it.
Decoding the whole prefix each step costs O(length) per token; it is exact for every tokenizer
(byte-level BPE, SentencePiece's leading spaces), which a per-token decode is not.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

_BROKEN = "\ufffd"


def fast_decoder(tokenizer):
    """``ids -> text`` equal to ``tokenizer.decode(ids, skip_special_tokens=True)``: an HF fast
    tokenizer's Rust backend called directly (plus the same clean-up HF applies), since the Python
    wrapper's argument conversion costs more than the decode itself at one call per token."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
    clean = getattr(tokenizer, "clean_up_tokenization", None)
    if cleanup and callable(clean):
        return lambda ids: clean(backend.decode(ids, skip_special_tokens=True))
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


class IncrementalText:
    def __init__(self, tokenizer, stops: List[str], decode=None):
        self.tokenizer = tokenizer
        self.decode = decode or fast_decoder(tokenizer)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.emitted = 0  # characters of the text handed out so far
        self.text = ""  # the choice's whole text so far (final text once finished)

    def update(self, ids: List[int]) -> Tuple[str, bool]:
        """(new stable text, whether a stop string ended the choice) after ``ids`` (all of them)."""
        if self.tokenizer is None:
            return "", False
        text = self.decode(ids)
        stop_at = self._stop_index(text)
        if stop_at is not None:
            self.text = text[:stop_at]
            return self._take(len(self.text)), True
        self.text = text
        stable = len(text.rstrip(_BROKEN)) if text.endswith(_BROKEN) else len(text)
        return self._take(stable - self.hold if self.stops else stable), False

    def finish(self) -> str:
        """The text not yet emitted, at the choice's end (nothing is held back any more)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _stop_index(self, text: str) -> Optional[int]:
        if not self.stops:
            return None
        # a stop string cannot lie wholly inside the text emitted before (it would have ended it)
        start = max(0, self.emitted - self.hold - 1)
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None


__all__ = ["IncrementalText"]
