"""The engine's per-token logprobs (``{"token_id", "logprob", "top_logprobs": [(id, logprob)]}``)
in OpenAI's two formats: completions' parallel lists and chat's ``content`` entries.

Only the tokens of the text a choice returns get an entry, as vLLM's do: the EOS / stop token
id that ended a choice and the tokens of a stop string (which the text leaves out) get none, so
the tokens join to the text and every ``text_offset`` lies within it. ``ChoiceTokens`` does that
for one choice, chunk by chunk: a token's entry is handed out once the text it decodes to has
been (a streamed choice holds back text that could still become a stop string, and so its
logprobs), and at the choice's end only the tokens starting inside its text are kept (a token
that straddles a stop string's start covers text the choice returns, so it counts).
"""

from __future__ import annotations

import math
from collections import deque
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from hyper_gen.engine.detokenize import fast_decoder

from .protocol import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else -9999.0  # JSON has no -inf; OpenAI's clients expect floats


class ChoiceTokens:
    """One choice's logprob entries, released as far as its text goes: ``add(chunk)`` returns
    ``[(entry, text_offset), ...]`` for the tokens whose text has now been returned."""

    def __init__(self, decode):
        self.decode = decode  # ids -> text, as the engine decodes a choice's text (None: no tokenizer)
        self.ids: List[int] = []
        self.end = 0  # length of the text the ids so far decode to
        self.text_len = 0  # characters of text the choice has returned
        self.pending: deque = deque()  # (entry, start, end) not yet released

    def add(self, chunk) -> List[Tuple[dict, int]]:
        self.text_len += len(chunk.text or "")
        entries = chunk.logprobs or ()
        if self.decode is None:  # no text to align to: every token counts
            out = [(entry, 0) for entry in entries]
            return out
        for token_id, entry in zip(chunk.token_ids, entries):
            self.ids.append(int(token_id))
            start, self.end = self.end, len(self.decode(self.ids))
            self.pending.append((entry, start, self.end))
        out = []
        while self.pending:
            entry, start, end = self.pending[0]
            if start >= self.text_len or not (end <= self.text_len or chunk.finished):
                break
            self.pending.popleft()
            out.append((entry, min(start, self.text_len)))
        if chunk.finished:
            self.pending.clear()  # the EOS / stop token, a stop string's tokens: no text of the choice
        return out


class TokenStrings:
    """Token id -> its text (as the id alone decodes), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self._decode = fast_decoder(tokenizer)

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([int(token_id)])

    def choice(self) -> ChoiceTokens:
        """A new choice's aligner (one per choice of a response)."""
        return ChoiceTokens(self._decode)

    def completion(self, entries: List[Tuple[dict, int]]) -> CompletionLogprobs:
        """``[(entry, text_offset), ...]`` (from ``ChoiceTokens.add``) in completions' format."""
        out = CompletionLogprobs()
        for entry, offset in entries:
            out.tokens.append(self.text(entry["token_id"]))
            out.token_logprobs.append(_finite(entry["logprob"]))
            out.top_logprobs.append({self.text(i): _finite(lp) for i, lp in entry.get("top_logprobs") or ()})
            out.text_offset.append(offset)
        return out

    def prompt(self, entries: List[Optional[dict]]) -> List[Optional[Dict[str, PromptLogprob]]]:
        """``RequestOutput.prompt_logprobs`` in vLLM's format: per position the prompt token, then the top k."""
        out: List[Optional[Dict[str, PromptLogprob]]] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            tokens = {str(entry["token_id"]): self._prompt_logprob(entry["token_id"], entry["logprob"], entry["rank"])}
            for rank, (token_id, logprob) in enumerate(entry["top_logprobs"], 1):
                tokens.setdefault(str(token_id), self._prompt_logprob(token_id, logprob, rank))
            out.append(tokens)
        return out

    def _prompt_logprob(self, token_id: int, logprob: float, rank: int) -> PromptLogprob:
        return PromptLogprob(logprob=_finite(logprob), rank=int(rank), decoded_token=self.text(token_id))

    def chat(self, entries: List[Tuple[dict, int]]) -> ChatLogprobs:
        content = []
        for entry, _ in entries:
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
