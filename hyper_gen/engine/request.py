"""A request and its choices as the engine core keeps them (host bookkeeping only: token ids, no text)."""

from __future__ import annotations

from typing import List, Optional

from .params import SamplingParams


class Request:
    """``serial``: the engine's own number for it (the same on every rank of a multi-rank engine);
    ``noise_seed``: the seed its draws use (``params.seed``, or one drawn from fresh entropy)."""

    def __init__(self, serial: int, request_id: str, prompt: List[int], params: SamplingParams, noise_seed: int):
        self.serial = serial
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.noise_seed = noise_seed
        self.stream = None  # RequestStream on rank 0; None on the other ranks
        self.state = None  # rank 0: the output processor's RequestState (output_processor.py), its alone
        self.choices: List[Choice] = []
        self.stop_ids: frozenset = frozenset()
        self.dropped: set = set()  # indices of its choices that have left the engine
        self.prompt_logprobs: Optional[list] = None  # vLLM's prompt_logprobs entries (rank 0), from its prefill
        self.cached_tokens = 0  # rank 0: prompt tokens its first admission found in the prefix cache

    def open_choices(self, eos_ids) -> None:
        """The n choices, and the ids that end one: EOS (unless ignore_eos) and stop_token_ids."""
        p = self.params
        self.stop_ids = frozenset((p.stop_token_ids or [])) | (frozenset() if p.ignore_eos else frozenset(eos_ids))
        self.choices = [Choice(self, i) for i in range(p.n)]

    @property
    def finished(self) -> bool:
        """Every choice has ended in the core (its stream may still be catching up)."""
        return bool(self.choices) and all(c.finish_reason is not None for c in self.choices)


class Choice:
    """One of a request's n sequences; one batch row while it runs."""

    def __init__(self, request: Request, index: int):
        self.request = request
        self.index = index
        self.token_ids: List[int] = []  # every id drawn (after a stop string too, until its abort arrives)
        self.finish_reason: Optional[str] = None  # as the core ended it (rank 0; "error" on any rank)
        self.seen = None  # device (1, V) bool of ids seen so far, for the repetition penalty
        self.grammar = None  # structured outputs: [its llguidance matcher, tokens consumed] (hyper_gen/grammar.py)

    @property
    def key(self):
        return (self.request.serial, self.index)

    @property
    def step(self) -> int:
        """The index of the token it draws next (0 for the first): the seeded noise's step."""
        return len(self.token_ids)


__all__ = ["Request", "Choice"]
