"""``echo: true`` on ``/v1/completions``, as vLLM implements it: each choice's text starts with its
prompt's, and with ``logprobs`` its entries start with the prompt tokens' (the first with no
logprob, then each given the ones before it: the engine's ``prompt_logprobs`` from the prefill
forward, what ``score()`` gives). ``max_tokens: 0`` scores the prompt only: the engine still draws
one token (it always does), which the choice leaves out and usage does not count.

This is how evaluation harnesses (lm-evaluation-harness' ``local-completions``) compute a
continuation's loglikelihood: they send context + continuation as one prompt and read the
continuation's entries.
"""

from __future__ import annotations

from typing import List, Optional

from .logprobs import merge_completion
from .protocol import CompletionChoice, CompletionRequest


def prompt_texts(request: CompletionRequest, prompts: List[List[int]], tokenizer) -> List[str]:
    """Each prompt's text as echoed: a text prompt as sent, token ids decoded (vLLM's)."""
    sent = request.prompt
    if isinstance(sent, str):
        sent = [sent]
    texts = []
    for i, ids in enumerate(prompts):
        if isinstance(sent[i], str):
            texts.append(sent[i])
        else:
            texts.append("" if tokenizer is None else tokenizer.decode(ids))
    return texts


def prepend(
    choice: CompletionChoice, state, request: CompletionRequest, prompt: List[int], text: str, found: Optional[list]
) -> None:
    """``choice`` (what was generated, or nothing for ``max_tokens: 0``) with its prompt in front."""
    scoring_only = request.max_tokens == 0
    if scoring_only:  # the one token the engine drew is not the client's
        choice.text, choice.finish_reason = "", "length"
        if choice.token_ids is not None:
            choice.token_ids = []
    generated = None if scoring_only else choice.logprobs
    choice.text = text + choice.text
    if request.logprobs is None:
        return
    choice.logprobs = state.tokens.echoed(prompt, found or [], request.logprobs)
    if generated is not None:
        generated.text_offset = [offset + len(text) for offset in generated.text_offset]
        merge_completion(choice.logprobs, generated)
