"""What ``generate(..., return_dict_in_generate=True)`` returns: HF's names, plus logprobs.

PPO needs, for every generated token, its log-probability under the policy that sampled it (the
importance ratio's denominator) and under the raw model (a KL term): vLLM returns the first as
``logprobs``; HF leaves both to the caller, from ``scores`` / ``logits``. Both are computed here on
the device, one gather per step, only when ``output_logprobs=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Tuple

import numpy as np

from .sampling import chosen_and_top_logprobs, log_softmax


class HostInts(np.ndarray):
    """A (B,) int64 host array whose elements come out as Python ints: by index, by iteration and from
    reductions (``lengths[i]``, ``for n in lengths``, ``lengths.max()``), so they slice a tensor of
    either framework (MindSpore refuses numpy integers as slice bounds: ``seq[i, start : start + n]``
    would raise). Everything else is numpy's (``tolist()``, arithmetic, ``lengths[:, None]``; results
    of arithmetic are plain arrays)."""

    def __new__(cls, values):
        return np.array(values, dtype=np.int64).view(cls)

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return int(item) if isinstance(item, np.integer) else item

    def __iter__(self):
        return iter(self.tolist()) if self.ndim == 1 else super().__iter__()

    def __array_wrap__(self, array, context=None, return_scalar=False):
        array = np.asarray(array)
        return array.item() if array.ndim == 0 else array


@dataclass
class GenerateOutput:
    """``sequences``: what ``generate`` returns without ``return_dict_in_generate`` (each row
    ``[prompt without padding | generated tokens | pad]``); ``generated_lengths`` / ``prompt_lengths``
    (B,) host ints say where each row's generated tokens are, so step t of row i is
    ``sequences[i, prompt_lengths[i] + t]`` for t < ``generated_lengths[i]``.

    - ``scores``: with ``output_scores=True``, one (B, V) float32 tensor per step, the distribution
      the token was chosen from as HF reports it (after the logits processors, and after the
      temperature / top-k / top-p / min-p warpers when sampling);
    - ``logits``: with ``output_logits=True``, one (B, V) float32 tensor per step, the model's raw
      (vocab-gathered) logits;
    - ``logprobs`` / ``raw_logprobs``: with ``output_logprobs=True``, (B, T) tensors: the chosen
      token's log-softmax under ``scores`` (the distribution sampled from) and under the raw
      ``logits``; 0 past a row's end. float32, or float64 for a model whose logits are float64
      (computed from its float64 logits: the processors and temperature redone in float64 on the
      support the float32 chain kept; a ``logits_processor``'s float32 result is used as is);
      ``hyper_gen.score`` on the returned sequences gives ``raw_logprobs`` again;
    - ``top_logprobs`` / ``top_logprob_ids``: with ``output_logprobs=True`` and ``top_logprobs=k``,
      (B, T, k) tensors: each step's k most probable tokens under the raw ``logits`` (vLLM's
      ``logprobs=k``, the engine's ``top_logprobs``), best first: their log-softmax (the dtype of
      ``raw_logprobs``) and their ids (int64); 0 and ``pad_token_id`` past a row's end;
    - ``routed_experts`` / ``prompt_routed_experts``: with ``return_routed_experts=True`` (MoE models),
      host int64 arrays of the expert ids each MoE layer's router chose, in its top-k order, as vLLM and
      SGLang return them for routing replay: a position's routing is the one of the forward that fed
      its token. ``routed_experts`` (B, T, moe_layers, top_k): step t's forward, the one whose logits
      chose generated token t, fed sequence position ``prompt_lengths[i] + t - 1`` (the last prompt
      token for t = 0, generated token t - 1 after); -1 past a row's end. ``prompt_routed_experts``
      (B, P, moe_layers, top_k): the prefill's routing of every prompt token, left-aligned like
      ``sequences`` (-1 after a row's prompt), so its column ``prompt_lengths[i] - 1`` is step 0's;
      ``sequence_routed_experts(i)`` joins them: one entry per token of row i that was fed.
    """

    sequences: Any
    prompt_lengths: np.ndarray
    generated_lengths: np.ndarray
    scores: Optional[Tuple[Any, ...]] = None
    logits: Optional[Tuple[Any, ...]] = None
    logprobs: Optional[Any] = None
    raw_logprobs: Optional[Any] = None
    top_logprobs: Optional[Any] = None
    top_logprob_ids: Optional[Any] = None
    routed_experts: Optional[np.ndarray] = None
    prompt_routed_experts: Optional[np.ndarray] = None

    def sequence_routed_experts(self, row: int) -> np.ndarray:
        """(n, moe_layers, top_k): the routing of every token of ``sequences[row]`` the model was fed,
        n = prompt + generated tokens - 1 (the last token is never fed), vLLM's / SGLang's layout."""
        if self.routed_experts is None:
            raise ValueError("this output has no routed experts: generate with return_routed_experts=True")
        prompt, generated = self.prompt_lengths[row], self.generated_lengths[row]
        return np.concatenate([self.prompt_routed_experts[row, :prompt], self.routed_experts[row, 1:generated]], axis=0)

    def __getitem__(self, name: str):
        """``out["sequences"]`` as on HF's ``ModelOutput``."""
        if name not in self.keys():
            raise KeyError(f"{name!r} is not in this output; it holds {list(self.keys())}")
        return getattr(self, name)

    def keys(self):
        """The fields that are set (HF's ``ModelOutput`` lists only those)."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


class RoutedExperts:
    """The router choices of a generate call (``return_routed_experts=True``), kept on the host.

    A model that reports routing declares ``moe_layers`` (its MoE layer count) and
    ``record_routes(routes)``: given a list, each MoE layer appends, in layer order, the (N, top_k)
    expert ids its router chose in every forward (a framework tensor or numpy array; N = the
    forward's B * S positions, or the real positions of a left-padded prefill the port packed, row
    by row); ``record_routes(None)`` stops it, so nothing is kept, or costs, otherwise."""

    def __init__(self, ops, model):
        layers = getattr(model, "moe_layers", 0)
        if not layers or not callable(getattr(model, "record_routes", None)):
            raise ValueError(
                f"return_routed_experts=True: {type(model).__name__} has no MoE layers whose routing it reports "
                "(a dense model, or one without moe_layers / record_routes)"
            )
        if getattr(model, "context_parallel", None) is not None:
            raise ValueError("return_routed_experts=True is not supported under context parallelism (cp > 1)")
        self.ops, self.model, self.layers = ops, model, int(layers)
        self.steps: list = []  # per step: (B, moe_layers, top_k)
        self.prompt: Optional[np.ndarray] = None  # (B, P, moe_layers, top_k), the prompt's padding left

    def forward(self, call, *args):
        """``call(*args)`` (one forward) with its routing recorded: (its result, its routes)."""
        routes: list = []
        self.model.record_routes(routes)
        try:
            return call(*args), routes
        finally:
            self.model.record_routes(None)

    def positions(self, routes: list, mask: np.ndarray) -> np.ndarray:
        """(B, S, moe_layers, top_k) of one forward over (B, S) positions (``mask``: 1 = a real token),
        -1 at the padding."""
        if len(routes) != self.layers:
            raise RuntimeError(f"{len(routes)} MoE layers recorded their routing, the model declares {self.layers}")
        ids = np.stack([np.asarray(r if isinstance(r, np.ndarray) else self.ops.to_numpy(r)) for r in routes], 1)
        real = mask.reshape(-1) != 0
        out = np.full((real.size,) + ids.shape[1:], -1, dtype=np.int64)
        if ids.shape[0] == real.size:  # every position ran
            out[real] = ids[real]
        elif ids.shape[0] == int(real.sum()):  # the real positions, packed
            out[real] = ids
        else:
            raise RuntimeError(f"the MoE layers routed {ids.shape[0]} positions in a forward over {mask.shape}")
        return out.reshape(mask.shape + ids.shape[1:])

    def prefill(self, routes: list, mask: np.ndarray, rows: np.ndarray) -> None:
        """The prefill over the (B0, P) prompt, its rows then repeated (``rows``: num_return_sequences)."""
        routed = self.positions(routes, mask)[rows]
        self.steps.append(routed[:, -1])
        self.prompt = routed

    def decode(self, routes: list, mask: np.ndarray) -> None:
        """A step's forward: one token per row, or the whole sequence again (``use_cache=False``)."""
        self.steps.append(self.positions(routes, mask)[:, -1])

    def finish(self, prompt_mask: np.ndarray, generated_lengths: np.ndarray):
        """(routed_experts, prompt_routed_experts): past a row's end -1, the prompt left-aligned."""
        routed = np.stack(self.steps, 1)
        routed[np.arange(routed.shape[1])[None, :] >= generated_lengths[:, None]] = -1
        prompt = np.full_like(self.prompt, -1)
        for row, real in enumerate(prompt_mask != 0):
            prompt[row, : int(real.sum())] = self.prompt[row, real]
        return routed, prompt


class StepRecorder:
    """Collects, step by step on the device, what ``GenerateOutput`` reports."""

    def __init__(self, ops, config):
        self.ops = ops
        self.pad_token_id = config.pad_token_id
        self.scores = [] if config.output_scores else None
        self.logits = [] if config.output_logits else None
        self.logprobs = [] if config.output_logprobs else None
        self.raw_logprobs = [] if config.output_logprobs else None
        self.top_k = config.top_logprobs if config.output_logprobs else 0
        self.top_logprobs = [] if self.top_k else None
        self.top_logprob_ids = [] if self.top_k else None

    @property
    def wants_wide(self) -> bool:
        """Whether the step's float64 logits are worth handing over (they are for the logprobs only)."""
        return self.logprobs is not None

    def record(self, raw, processed, tokens_device, wide=None, wide_processed=None) -> None:
        """One step: ``raw`` (B, V) float32 logits, ``processed`` the scores sampled from, the chosen (B, 1);
        ``wide`` / ``wide_processed``: the same in float64 (a float64 model), which the logprobs then use."""
        ops = self.ops
        if self.scores is not None:
            self.scores.append(processed)
        if self.logits is not None:
            self.logits.append(raw)
        if self.logprobs is not None:
            sampled_from = processed if wide_processed is None else wide_processed
            self.logprobs.append(ops.take_along_axis(log_softmax(ops, sampled_from), tokens_device, -1))
            chosen, values, ids = chosen_and_top_logprobs(ops, raw if wide is None else wide, tokens_device, self.top_k)
            self.raw_logprobs.append(chosen)
            if self.top_k:
                self.top_logprobs.append(values[:, None, :])
                self.top_logprob_ids.append(ids[:, None, :])

    def finish(self, sequences, prompt_lengths, generated_lengths, routes=None) -> GenerateOutput:
        """``routes``: the (routed_experts, prompt_routed_experts) of ``RoutedExperts.finish``, if asked."""
        ops = self.ops
        logprobs = raw_logprobs = top_logprobs = top_logprob_ids = None
        if self.logprobs is not None:
            steps = len(self.logprobs)
            inside = np.arange(steps)[None, :] < generated_lengths[:, None]  # (B, T): a row's own tokens
            logprobs = ops.where(ops.asarray(inside, "bool"), ops.concat(self.logprobs, 1), 0.0)
            raw_logprobs = ops.where(ops.asarray(inside, "bool"), ops.concat(self.raw_logprobs, 1), 0.0)
            if self.top_k:
                inside = ops.asarray(inside[:, :, None], "bool")
                top_logprobs = ops.where(inside, ops.concat(self.top_logprobs, 1), 0.0)
                top_logprob_ids = ops.where(inside, ops.concat(self.top_logprob_ids, 1), self.pad_token_id)
        return GenerateOutput(
            sequences=sequences,
            prompt_lengths=HostInts(prompt_lengths),
            generated_lengths=HostInts(generated_lengths),
            scores=None if self.scores is None else tuple(self.scores),
            logits=None if self.logits is None else tuple(self.logits),
            logprobs=logprobs,
            raw_logprobs=raw_logprobs,
            top_logprobs=top_logprobs,
            top_logprob_ids=top_logprob_ids,
            routed_experts=None if routes is None else routes[0],
            prompt_routed_experts=None if routes is None else routes[1],
        )
