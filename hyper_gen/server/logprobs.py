"""The engine's per-token logprobs (``{"token_id", "logprob", "top_logprobs": [(id, logprob)]}``)
in OpenAI's two formats: completions' parallel lists and chat's ``content`` entries.

Every token a choice generated (each one ``usage.completion_tokens`` counts) gets an entry, as
vLLM's do: lm-eval reads a choice's ``token_logprobs[ctxlen:-1]``, so a missing last entry (the
EOS that ended it) would drop a real token. The tokens the text leaves out (the EOS / stop token
id that ended a choice, the tokens of a stop string) show as ``""`` at the text's end, so the
tokens still join to the text and every ``text_offset`` lies within it or at its end.
``ChoiceTokens`` does that for one choice, chunk by chunk: a token's entry is handed out once the
text it decodes to has been (a streamed choice holds back text that could still become a stop
string, and so its logprobs); at the choice's end the tokens starting inside its text keep their
text (a token that straddles a stop string's start covers text the choice returns) and the rest
show as ``""``.

``echo`` (completions): the prompt's entries come first, vLLM's way: the first prompt token with
no logprob (nothing before it), then each prompt token's logprob given the ones before it (the
engine's ``prompt_logprobs``, from the prefill forward).
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
    ``[(entry, text_offset, shown), ...]`` for the tokens whose text has now been returned
    (``shown`` false: a token past the choice's text, which it shows as ``""``)."""

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
            return [(entry, 0, True) for entry in entries]
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
            out.append((entry, min(start, self.text_len), True))
        if chunk.finished:  # the EOS / stop token, a stop string's tokens: counted, no text of the choice
            out += [(entry, self.text_len, False) for entry, _, _ in self.pending]
            self.pending.clear()
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

    def completion(self, entries: List[Tuple[dict, int, bool]], shift: int = 0) -> CompletionLogprobs:
        """``[(entry, text_offset, shown), ...]`` (from ``ChoiceTokens.add``) in completions' format,
        offsets moved by ``shift`` (the echoed prompt's length)."""
        out = CompletionLogprobs()
        for entry, offset, shown in entries:
            out.tokens.append(self.text(entry["token_id"]) if shown else "")
            out.token_logprobs.append(_finite(entry["logprob"]))
            out.top_logprobs.append({self.text(i): _finite(lp) for i, lp in entry.get("top_logprobs") or ()})
            out.text_offset.append(offset + shift)
        return out

    def echoed(self, prompt: List[int], entries: List[Optional[dict]], k: int) -> CompletionLogprobs:
        """The prompt's entries for ``echo`` with ``logprobs=k`` (``entries``: the engine's
        ``prompt_logprobs``, top k or more): vLLM's, offsets the running length of the tokens' texts."""
        out, offset = CompletionLogprobs(), 0
        for token_id, entry in zip(prompt, entries):
            token = self.text(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None:  # the first token: nothing before it to score it by
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(entry["logprob"]))
            out.top_logprobs.append({self.text(i): _finite(lp) for i, lp in entry["top_logprobs"][:k]})
        return out

    def prompt(self, entries: list, k: Optional[int] = None) -> List[Optional[Dict[str, PromptLogprob]]]:
        """``RequestOutput.prompt_logprobs`` in vLLM's format: per position the prompt token, then the top
        ``k`` (None: every one the engine gave)."""
        out: List[Optional[Dict[str, PromptLogprob]]] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            tokens = {str(entry["token_id"]): self._prompt_logprob(entry["token_id"], entry["logprob"], entry["rank"])}
            for rank, (token_id, logprob) in enumerate(entry["top_logprobs"][:k], 1):
                tokens.setdefault(str(token_id), self._prompt_logprob(token_id, logprob, rank))
            out.append(tokens)
        return out

    def _prompt_logprob(self, token_id: int, logprob: float, rank: int) -> PromptLogprob:
        return PromptLogprob(logprob=_finite(logprob), rank=int(rank), decoded_token=self.text(token_id))

    def chat(self, entries: List[Tuple[dict, int, bool]]) -> ChatLogprobs:
        content = []
        for entry, _, shown in entries:
            token = self.text(entry["token_id"]) if shown else ""
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
