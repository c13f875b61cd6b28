"""Next-token selection with HF's order and math (design guide, "Sampling semantics").

repetition penalty -> min_new_tokens EOS mask -> user logits processors -> (sampling only)
temperature -> top-k -> top-p -> min-p -> softmax -> draw. Every op is the one HF uses, in the
same dtype (float32), so the scores are bit-identical to HF's and ``torch.multinomial`` on them
consumes the RNG exactly as HF does.

Non-finite scores, one policy on every backend and path: a still-running row whose scores,
after the processors (repetition penalty, min_new_tokens, logits_processor) and before the
sampling warpers, contain NaN or +inf, or are all -inf, raises ``ValueError`` naming the step and
the row(s): no token can be chosen from them (greedy would silently emit the pad id, sampling
differed between frameworks). The check costs one reduction per step, each row's sum
(NaN-propagating on every framework, where MindSpore's max ignores NaN), and one (B,) copy to the
host; only on steps where a running row's sum is not finite (some -inf: min_new_tokens, a masking
processor) is the row max fetched too.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from . import processors
from .config import GenerationConfig
from .noise import sample_candidates

NEG_INF = -math.inf


class TokenSelector:
    """Turns one step's float32 scores (B, V) into next tokens (B,) on the host.

    ``seed=None`` follows HF op for op on the device (bit-identical scores, HF's multinomial);
    ``seed=<int>`` hands the top-k candidates to the portable host sampler (noise.py), keyed by
    the global row (``row_offset`` + row), so data-parallel ranks never draw the same noise.
    """

    def __init__(self, ops, config: GenerationConfig, prompt, vocab_size: int, row_offset: int = 0):
        self.ops = ops
        self.config = config
        self.vocab_size = vocab_size
        batch = prompt.batch_size
        self.batch_size = batch
        self.row_offset = row_offset  # this batch's first global row (data-parallel ranks): seeded noise key
        self.keep_scores = bool(config.output_scores or config.output_logprobs)
        self.last_scores = None
        self._eos_mask = processors.token_mask(ops, config.eos_token_ids, vocab_size) if config.min_new_tokens else None
        self._seen = None
        if config.repetition_penalty != 1.0:
            self._seen = processors.seen_tokens(ops, (prompt.real_tokens(row) for row in range(batch)), vocab_size)
            self._true_column = ops.asarray(np.ones((batch, 1), dtype=bool), "bool")
        self._keep_top = None  # the seeded path warps on the device too when scores / logprobs are kept
        if config.do_sample and config.top_p < 1.0:
            keep = np.ones((1, vocab_size), dtype=bool)
            keep[0, -1] = False  # the most probable token always survives top-p
            self._keep_top = ops.asarray(keep, "bool")

    def observe(self, tokens) -> None:
        """Record the tokens just appended (B, 1) device int64, for the repetition penalty."""
        if self._seen is not None:
            self._seen = processors.mark_seen(self.ops, self._seen, tokens, self.vocab_size, self._true_column)

    def process(self, scores, step: int, input_ids_view=None):
        """Processors every strategy applies: repetition penalty, min_new_tokens, the user's."""
        ops, cfg = self.ops, self.config
        if self._seen is not None:
            scores = processors.repetition_penalty(ops, scores, self._seen, cfg.repetition_penalty)
        if self._eos_mask is not None and step < cfg.min_new_tokens:
            scores = processors.masked(ops, scores, self._eos_mask)
        for index, processor in enumerate(cfg.logits_processor or ()):
            scores = self._checked(processor(input_ids_view, scores), index, processor)
        return scores

    def _checked(self, scores, index: int, processor):
        """A user processor's result: a tensor of this framework, (B, V) like its input."""
        expected = (self.batch_size, self.vocab_size)
        if not self.ops.is_tensor(scores):
            raise TypeError(
                f"logits_processor[{index}] ({_name(processor)}) must return a {self.ops.name} tensor of shape "
                f"(B, V) = {expected}, got {type(scores).__name__}"
            )
        shape = tuple(int(n) for n in scores.shape)
        if shape != expected:
            raise ValueError(
                f"logits_processor[{index}] ({_name(processor)}) returned scores of shape {shape}, expected (B, V) = "
                f"{expected}: one score per token of every row"
            )
        return scores

    def _check_finite(self, scores, sums, step: int, active: Optional[np.ndarray]) -> None:
        """Raise for the running rows whose scores hold NaN or +inf, or are all -inf."""
        bad = processors.unusable_rows(self.ops, scores, sums, active)
        if not bad:
            return
        kinds = [f"row {row}'s scores {kind}" for row, kind in bad]
        raise ValueError(
            f"generate() step {step}: {', '.join(kinds)} after the logits processors, so no token can be chosen "
            "(a running row whose scores contain NaN or +inf, or are all -inf, is an error on every backend); "
            "check the model's logits (overflow in a low-precision dtype?) and logits_processor / "
            "repetition_penalty / min_new_tokens"
        )

    def warp(self, scores):
        """HF's sampling warpers on the device: temperature -> top-k -> top-p -> min-p."""
        ops, cfg = self.ops, self.config
        if cfg.temperature != 1.0:
            scores = scores / cfg.temperature
        if cfg.top_k != 0:
            kth = ops.topk(scores, min(cfg.top_k, self.vocab_size))[0][:, -1:]
            scores = ops.where(scores < kth, NEG_INF, scores)
        if cfg.top_p < 1.0:
            sorted_scores, sorted_index = ops.sort(scores, descending=False)
            cumulative = ops.cumsum(ops.softmax(sorted_scores, axis=-1), axis=-1)
            remove_sorted = (cumulative <= (1 - cfg.top_p)) & self._keep_top
            remove = ops.scatter(remove_sorted, sorted_index, remove_sorted, axis=-1)
            scores = ops.where(remove, NEG_INF, scores)
        if cfg.min_p > 0:
            probs = ops.softmax(scores, axis=-1)
            scores = ops.where(probs < cfg.min_p * ops.max(probs, axis=-1), NEG_INF, scores)
        return scores

    def _draw(self, scores, warped, step: int) -> np.ndarray:
        """(B,) host int64 tokens: greedy argmax; HF-exact framework-RNG sample; or seeded host sample.

        ``warped``: the warpers' output, where the caller has it (the framework-RNG draw needs it)."""
        ops, cfg = self.ops, self.config
        if not cfg.do_sample:
            return ops.to_numpy(ops.argmax(scores, axis=-1))
        if cfg.seed is None:
            return ops.to_numpy(ops.multinomial(ops.softmax(warped, axis=-1)))
        rows = self.row_offset + np.arange(self.batch_size)
        if cfg.top_k:
            values, indices = ops.topk(scores, min(cfg.top_k, self.vocab_size))
            return sample_candidates(ops.to_numpy(values), ops.to_numpy(indices), cfg, step, rows)
        host = ops.to_numpy(scores)
        return sample_candidates(host, np.broadcast_to(np.arange(host.shape[1]), host.shape), cfg, step, rows)

    def select(self, scores, step: int, input_ids_view=None, active: Optional[np.ndarray] = None) -> np.ndarray:
        """(B,) host int64 tokens; ``active`` (B,) bool: the rows still running (the only ones whose
        non-finite scores raise; None = all). With ``keep_scores``, ``last_scores`` is the step's
        distribution as HF's ``output_scores`` reports it: after the processors, and after the
        warpers when sampling (on the device, also on the seeded path, whose draw warps on the host)."""
        cfg = self.config
        scores = self.process(scores, step, input_ids_view)
        sums = processors.row_sums(self.ops, scores)
        if cfg.do_sample:
            # before the draw: the framework's multinomial raises (torch) or picks silently (MindSpore) on
            # NaN, and the host sampler would warn
            self._check_finite(scores, sums, step, active)
            warped = self.warp(scores) if (self.keep_scores or cfg.seed is None) else None
            self.last_scores = warped
            return self._draw(scores, warped, step).astype(np.int64).reshape(-1)
        tokens = self._draw(scores, None, step)  # argmax cannot fail: its sync first, then the check's small copy
        self._check_finite(scores, sums, step, active)
        self.last_scores = scores
        return tokens.astype(np.int64).reshape(-1)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def apply_stopping_criteria(criteria, input_ids_view, scores, batch: int) -> Optional[np.ndarray]:
    """OR of the user's criteria as a (B,) bool host array; None when there are none."""
    if not criteria:
        return None
    from .registry import to_host

    stop = np.zeros(batch, dtype=bool)
    for index, criterion in enumerate(criteria):
        result = np.asarray(to_host(criterion(input_ids_view, scores)))
        if result.dtype != bool and not np.issubdtype(result.dtype, np.integer):
            raise TypeError(f"stopping criterion {criterion!r} must return a bool or (B,) bools, got {result.dtype}")
        if result.size not in (1, batch):
            raise ValueError(
                f"stopping_criteria[{index}] ({_name(criterion)}) returned shape {result.shape}, expected a bool "
                f"or (B,) = ({batch},) bools, one per row (input_ids {tuple(input_ids_view.shape)}, scores "
                f"{tuple(scores.shape)})"
            )
        stop |= np.broadcast_to(result.astype(bool).reshape(-1), (batch,))
    return stop
