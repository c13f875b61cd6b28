"""A choice's text decoded on the server, for the requests that want what the engine's text leaves out.

The engine hands out each choice's text as ``tokenizer.decode(ids, skip_special_tokens=True)``
with a matched stop string cut off, as vLLM and OpenAI do. SGLang's ``no_stop_trim: true`` keeps
the stop string (and a stop token's text) in it, and ``skip_special_tokens: false`` keeps special
tokens; such a choice's text is decoded here from its token ids instead, whole or piece by piece
for a stream. Without a stop trimmed, the token that ended the choice stays out of the text (an
EOS is no part of the answer) unless ``no_stop_trim`` keeps it, as in SGLang's detokenizer.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence


def wanted(skip_special_tokens: bool, no_stop_trim: bool) -> bool:
    """Whether a choice's text must be decoded here rather than taken from the engine."""
    return no_stop_trim or not skip_special_tokens


class ChoiceText:
    """One choice's text from its token ids; ``add`` returns the text new since the last call."""

    def __init__(self, tokenizer, params, eos_ids: Iterable[int], skip_special_tokens: bool, no_stop_trim: bool):
        self.tokenizer, self.params = tokenizer, params
        self.skip, self.keep_stop = skip_special_tokens, no_stop_trim
        self.stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_ids))
        self.stops: List[str] = [] if no_stop_trim else list(params.stop_strings)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # a stop string may still be completing
        self.ids: List[int] = []
        self.shown = ""

    def text(self, finished: bool, reason) -> str:
        """The whole text of the ids so far (``finished``: the choice ended, for ``reason``)."""
        ids = self.ids
        if finished and reason == "stop" and ids and ids[-1] in self.stop_ids and not self.keep_stop:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip)
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return text[: min(found)] if found else text

    def add(self, token_ids: Sequence[int], finished: bool, reason=None) -> str:
        self.ids += [int(t) for t in token_ids]
        whole = self.text(finished, reason)
        if not finished:  # an unfinished character or stop string waits for the next ids
            whole = whole.rstrip("\ufffd")
            whole = whole[: max(len(self.shown), len(whole) - self.hold)]
        if not whole.startswith(self.shown):  # decoding more ids rewrote what was handed out: keep it
            return ""
        new, self.shown = whole[len(self.shown) :], whole
        return new


def texter(state, params, skip_special_tokens: bool, no_stop_trim: bool):
    """A factory of ``ChoiceText`` for one request's choices, or None when the engine's text serves."""
    if not wanted(skip_special_tokens, no_stop_trim) or state.tokenizer is None:
        return None
    eos = tuple(getattr(state.engine, "eos_token_ids", None) or ())
    return lambda: ChoiceText(state.tokenizer, params, eos, skip_special_tokens, no_stop_trim)
