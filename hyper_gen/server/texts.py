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

from hyper_gen.engine.detokenize import IncrementalText


def wanted(skip_special_tokens: bool, no_stop_trim: bool) -> bool:
    """Whether a choice's text must be decoded here rather than taken from the engine."""
    return no_stop_trim or not skip_special_tokens


class ChoiceText:
    """One choice's text from its token ids, through the engine's ``IncrementalText`` (a bounded window
    per token, stop strings held back); ``add`` returns the text new since the last call."""

    def __init__(self, tokenizer, params, eos_ids: Iterable[int], skip_special_tokens: bool, no_stop_trim: bool):
        self.keep_stop = no_stop_trim
        self.stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_ids))
        stops = [] if no_stop_trim else list(params.stop_strings)
        self.text = IncrementalText(tokenizer, stops, skip_special_tokens=skip_special_tokens)
        self.ids: List[int] = []

    def add(self, token_ids: Sequence[int], finished: bool, reason=None) -> str:
        self.ids += [int(t) for t in token_ids]
        ids = self.ids
        if finished and reason == "stop" and ids and ids[-1] in self.stop_ids and not self.keep_stop:
            ids = ids[:-1]  # the token that ended the choice is no part of its text
        new, _ = self.text.update(ids)
        return new + self.text.finish() if finished else new


def texter(state, params, skip_special_tokens: bool, no_stop_trim: bool):
    """A factory of ``ChoiceText`` for one request's choices, or None when the engine's text serves."""
    if not wanted(skip_special_tokens, no_stop_trim) or state.tokenizer is None:
        return None
    eos = tuple(getattr(state.engine, "eos_token_ids", None) or ())
    return lambda: ChoiceText(state.tokenizer, params, eos, skip_special_tokens, no_stop_trim)
