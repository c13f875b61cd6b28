"""Incremental text for one choice: stable deltas at O(1) amortized cost per token, and stop strings
with OpenAI / vLLM semantics.

Decoding keeps a small window of the choice's ids (vLLM's prefix / read offsets): the *context*, the
last ids already turned into text, then the *unread* ids. Each step decodes the window alone and
keeps what follows the context's own decode: the text the unread ids add, with the surroundings
decoders need (SentencePiece drops the leading space of a decode's first token only, and the
context's first token takes that place in both decodes; byte-level BPE joins the bytes of a
character spread over several tokens). While that text ends in U+FFFD (a character whose bytes have
not all arrived) the window grows and only the text before the broken character goes out; once it
ends cleanly, the unread ids become the next context. Ids that ``skip_special_tokens=True`` drops
never enter the window; unread ids that make no text (ids past the vocabulary, which decode drops
too) join the context instead of replacing it, since a decode starting after them would treat the
next token as the first one.

Cost per token: about two decodes of a window of a few ids, whatever the length of the output
(decoding the whole prefix each step is quadratic: ~134M ids for a 16k-token rollout). The result
equals ``tokenizer.decode(ids, skip_special_tokens=True)`` for byte-level BPE, Metaspace
(SentencePiece-style, byte fallback included) and WordPiece decoders; the one exception is a
byte-fallback run that is not valid UTF-8 (one U+FFFD per byte), which a later byte token can turn
back into text in the full decode after the U+FFFDs have gone out.

The clean-up of tokenization spaces (when the tokenizer asks for it, as ``fast_decoder`` applies it)
runs on the text stream, not on each window: transformers' rules are chained ``str.replace`` calls,
each streamed by holding back the end of a piece that could start its pattern (a space that a later
"." would remove must not have been sent).

Stop strings: the last ``len(longest stop) - 1`` characters are held back (they could still turn
out to be the start of a stop string, which must never reach the client), and only the new text plus
that held-back window is searched, since an earlier occurrence would already have ended the choice.
When a stop string appears, the choice ends and its text is everything before it. The emitted text
is kept as a list of pieces, joined only when ``text`` is read.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

_BROKEN = "\ufffd"

# transformers' PreTrainedTokenizerBase.clean_up_tokenization, in its order (each applies to the previous output)
CLEAN_UP_RULES = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _cleans(tokenizer) -> bool:
    """Whether ``fast_decoder`` applies the tokenizer's clean-up of tokenization spaces."""
    return bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)) and callable(
        getattr(tokenizer, "clean_up_tokenization", None)
    )


def fast_decoder(tokenizer, clean_up: bool = True, skip_special_tokens: bool = True):
    """``ids -> text`` equal to ``tokenizer.decode(ids, skip_special_tokens=...)``: an HF fast
    tokenizer's Rust backend called directly (plus the same clean-up HF applies), since the Python
    wrapper's argument conversion costs more than the decode itself at one call per token.
    ``clean_up=False`` leaves the clean-up out (``IncrementalText`` streams it itself)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    skip = skip_special_tokens
    if backend is None or not callable(getattr(backend, "decode", None)):
        if not clean_up and _cleans(tokenizer):
            return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
    if clean_up and _cleans(tokenizer):
        clean = tokenizer.clean_up_tokenization
        return lambda ids: clean(backend.decode(ids, skip_special_tokens=skip))
    return lambda ids: backend.decode(ids, skip_special_tokens=skip)


_SKIPPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _skipped_ids(tokenizer) -> frozenset:
    """The ids ``skip_special_tokens=True`` drops before the decoder sees the rest: the Rust
    backend's special added tokens, or a slow tokenizer's ``all_special_ids``. Found once per
    tokenizer (milliseconds with a thousand added tokens, and the engine opens a text per choice);
    a special token added later is still decoded right, as an id that makes no text."""
    try:
        return _SKIPPED[tokenizer]
    except (KeyError, TypeError):  # TypeError: an unhashable tokenizer, looked up each time
        pass
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    added = getattr(backend, "get_added_tokens_decoder", None)
    if callable(added):
        ids = frozenset(i for i, token in added().items() if token.special)
    else:
        ids = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
    try:
        _SKIPPED[tokenizer] = ids
    except TypeError:
        pass
    return ids


class _Replace:
    """``str.replace(old, new)`` over text that arrives in pieces: the end of the text that could be
    the start of ``old`` waits for the next piece (all of it goes out once ``final``)."""

    def __init__(self, old: str, new: str):
        self.old, self.new, self.pending = old, new, ""

    def __call__(self, text: str, final: bool) -> str:
        if not text and not final:
            return ""
        parts = (self.pending + text).split(self.old)
        last = parts[-1]
        keep = 0
        if not final:
            keep = next((k for k in range(min(len(self.old) - 1, len(last)), 0, -1) if last.endswith(self.old[:k])), 0)
        parts[-1], self.pending = last[: len(last) - keep], last[len(last) - keep :]
        return self.new.join(parts)


class IncrementalText:
    """One choice's text as its ids arrive (see the module docstring). ``decode`` is ``ids -> text``
    as ``tokenizer.decode(ids, skip_special_tokens=True)`` without the clean-up of tokenization
    spaces, which runs on the stream here when the tokenizer asks for it. ``skip_special_tokens=False``:
    special tokens keep their text (SGLang's option; the server's ``texts.py``)."""

    def __init__(self, tokenizer, stops: List[str], decode=None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.decode = decode or fast_decoder(tokenizer, clean_up=False, skip_special_tokens=skip_special_tokens)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.emitted = 0  # characters of the text handed out so far
        self._skip = _skipped_ids(tokenizer) if tokenizer is not None and skip_special_tokens else frozenset()
        self._clean = [_Replace(old, new) for old, new in CLEAN_UP_RULES] if _cleans(tokenizer) else []
        self._seen = 0  # ids of the choice looked at
        self._window: List[int] = []  # the context's ids, then the unread ones (skipped ids left out)
        self._read = 0  # window[:read] is the context
        self._context_text = ""  # decode(window[:read]): what the window's decode starts with
        self._sent = 0  # characters of the unread ids' text already passed on (the part before a U+FFFD)
        self._tail = ""  # the unread ids' text not passed on yet (it ends in U+FFFD)
        self._pieces: List[str] = []  # the emitted text
        self._held = ""  # settled text not emitted yet: it could be the start of a stop string
        self._done = False
        self._stopped = False

    @property
    def text(self) -> str:
        """The settled text so far (emitted or held back); the final text once finished, cut before a stop string."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return (self._pieces[0] if self._pieces else "") + self._held

    def update(self, ids: List[int]) -> Tuple[str, bool]:
        """(new stable text, whether a stop string ended the choice) after ``ids`` (all of them so
        far; only those past the previous call are read)."""
        if self.tokenizer is None:
            return "", False
        if self._done:
            return "", self._stopped
        skip = self._skip
        self._window.extend(i for i in ids[self._seen :] if i not in skip)
        self._seen = len(ids)
        return self._push(self._settle(self._unread_text(), final=False), final=False)

    def finish(self) -> str:
        """The text not yet emitted, at the choice's end (nothing is held back any more, a broken
        last character included, as the full decode has it)."""
        if self.tokenizer is None or self._done:
            return ""
        tail, self._tail = self._tail, ""
        return self._push(self._settle(tail, final=True), final=True)[0]

    def _unread_text(self) -> str:
        """The text the unread ids add that can no longer change; the window moves on once it ends cleanly."""
        if len(self._window) == self._read:
            return ""
        text = self.decode(self._window)[len(self._context_text) :]
        if text.endswith(_BROKEN):  # a character whose bytes have not all arrived: wait for them
            stable = len(text.rstrip(_BROKEN))
            new = text[self._sent : stable]
            self._sent = max(self._sent, stable)
            self._tail = text[self._sent :]
            return new
        new, self._sent, self._tail = text[self._sent :], 0, ""
        if text:  # the unread ids made text: they are the next context
            del self._window[: self._read]
            self._context_text = self.decode(self._window)
        self._read = len(self._window)
        return new

    def _settle(self, text: str, final: bool) -> str:
        for stage in self._clean:
            text = stage(text, final)
        return text

    def _push(self, text: str, final: bool) -> Tuple[str, bool]:
        """Emit ``text`` after the held-back window, up to a stop string or the part that could start one."""
        window = self._held + text
        stop = self._first_stop(window) if text else None  # the held-back window alone was searched before
        if stop is not None:
            window, final, self._stopped = window[:stop], True, True
        end = len(window) if final or not self.stops else max(0, len(window) - self.hold)
        piece, self._held = window[:end], window[end:]
        if piece:
            self._pieces.append(piece)
            self.emitted += len(piece)
        self._done = final
        return piece, self._stopped

    def _first_stop(self, window: str) -> Optional[int]:
        if not self.stops:
            return None
        found = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None


__all__ = ["IncrementalText", "fast_decoder"]
