"""Next-token selection with HF's order and math (design guide, "Sampling semantics").

repetition penalty -> min_new_tokens EOS mask -> user logits processors -> (sampling only)
temperature -> top-k -> top-p -> min-p -> softmax -> draw. Every op is the one HF uses, in the
same dtype (float32), so the scores are bit-identical to HF's and ``torch.multinomial`` on them
consumes the RNG exactly as HF does.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .config import GenerationConfig
from .noise import sample_candidates

NEG_INF = -math.inf


class TokenSelector:
    """Turns one step's float32 scores (B, V) into next tokens (B,) on the host.

    ``seed=None`` follows HF op for op on the device (bit-identical scores, HF's multinomial);
    ``seed=<int>`` hands the top-k candidates to the portable host sampler (noise.py).
    """

    def __init__(self, ops, config: GenerationConfig, prompt, vocab_size: int):
        self.ops = ops
        self.config = config
        self.vocab_size = vocab_size
        batch = prompt.batch_size
        eos_in_vocab = [e for e in config.eos_token_ids if e < vocab_size]
        self._eos_mask = None
        if config.min_new_tokens > 0 and eos_in_vocab:
            eos_mask = np.zeros((1, vocab_size), dtype=bool)
            eos_mask[0, eos_in_vocab] = True
            self._eos_mask = ops.asarray(eos_mask, "bool")
        self._seen = None
        if config.repetition_penalty != 1.0:
            seen = np.zeros((batch, vocab_size), dtype=bool)
            for row in range(batch):
                tokens = prompt.real_tokens(row)
                seen[row, tokens[tokens < vocab_size]] = True
            self._seen = ops.asarray(seen, "bool")
            self._true_column = ops.asarray(np.ones((batch, 1), dtype=bool), "bool")
        self._keep_top = None
        if config.do_sample and config.seed is None and config.top_p < 1.0:
            keep = np.ones((1, vocab_size), dtype=bool)
            keep[0, -1] = False  # the most probable token always survives top-p
            self._keep_top = ops.asarray(keep, "bool")

    def observe(self, tokens) -> None:
        """Record the tokens just appended (B, 1) device int64, for the repetition penalty."""
        if self._seen is not None:
            in_vocab = self.ops.where(tokens < self.vocab_size, tokens, 0)
            self._seen = self.ops.scatter(self._seen, in_vocab, self._true_column, axis=-1)

    def process(self, scores, step: int, input_ids_view=None):
        """Processors every strategy applies: repetition penalty, min_new_tokens, the user's."""
        ops, cfg = self.ops, self.config
        if self._seen is not None:
            penalty = cfg.repetition_penalty
            penalized = ops.where(scores < 0, scores * penalty, scores / penalty)
            scores = ops.where(self._seen, penalized, scores)
        if self._eos_mask is not None and step < cfg.min_new_tokens:
            scores = ops.where(self._eos_mask, NEG_INF, scores)
        for processor in cfg.logits_processor or ():
            scores = processor(input_ids_view, scores)
        return scores

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

    def draw(self, scores, step: int) -> np.ndarray:
        """(B,) host int64 tokens: greedy argmax; HF-exact framework-RNG sample; or seeded host sample."""
        ops, cfg = self.ops, self.config
        if not cfg.do_sample:
            return ops.to_numpy(ops.argmax(scores, axis=-1))
        if cfg.seed is None:
            return ops.to_numpy(ops.multinomial(ops.softmax(self.warp(scores), axis=-1)))
        if cfg.top_k:
            values, indices = ops.topk(scores, min(cfg.top_k, self.vocab_size))
            return sample_candidates(ops.to_numpy(values), ops.to_numpy(indices), cfg, step)
        host = ops.to_numpy(scores)
        return sample_candidates(host, np.broadcast_to(np.arange(host.shape[1]), host.shape), cfg, step)

    def select(self, scores, step: int, input_ids_view=None) -> np.ndarray:
        return self.draw(self.process(scores, step, input_ids_view), step).astype(np.int64).reshape(-1)


def apply_stopping_criteria(criteria, input_ids_view, scores, batch: int) -> Optional[np.ndarray]:
    """OR of the user's criteria as a (B,) bool host array; None when there are none."""
    if not criteria:
        return None
    from .registry import to_host

    stop = np.zeros(batch, dtype=bool)
    for criterion in criteria:
        result = np.asarray(to_host(criterion(input_ids_view, scores)))
        if result.dtype != bool and not np.issubdtype(result.dtype, np.integer):
            raise TypeError(f"stopping criterion {criterion!r} must return a bool or (B,) bools, got {result.dtype}")
        stop |= np.broadcast_to(result.astype(bool).reshape(-1) if result.ndim else result.astype(bool), (batch,))
    return stop
