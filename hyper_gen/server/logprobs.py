"""The engine's per-token logprobs (``{"token_id", "logprob", "top_logprobs": [(id, logprob)]}``)
in OpenAI's two formats: completions' parallel lists and chat's ``content`` entries."""

from __future__ import annotations

import math
from functools import lru_cache

from .protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else -9999.0  # JSON has no -inf; OpenAI's clients expect floats


class TokenStrings:
    """Token id -> its text (as the id alone decodes), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([int(token_id)])

    def completion(self, entries, offset: int = 0) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in entries or ():
            token = self.text(entry["token_id"])
            out.tokens.append(token)
            out.token_logprobs.append(_finite(entry["logprob"]))
            out.top_logprobs.append({self.text(i): _finite(lp) for i, lp in entry.get("top_logprobs") or ()})
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def chat(self, entries) -> ChatLogprobs:
        content = []
        for entry in entries or ():
            token = self.text(entry["token_id"])
            top = [
                TopLogprob(token=self.text(i), logprob=_finite(lp), bytes=list(self.text(i).encode("utf-8")))
                for i, lp in entry.get("top_logprobs") or ()
            ]
            content.append(
                TokenLogprob(
                    token=token, logprob=_finite(entry["logprob"]), bytes=list(token.encode("utf-8")), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)


def merge_completion(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset
