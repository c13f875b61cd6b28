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
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import processors
from .config import GenerationConfig
from .noise import sample_candidates

NEG_INF = -math.inf


class RowSettings(NamedTuple):
    """One row's draw: greedy, or seeded sampling with HF's warpers (what ``noise.sample_candidates``
    reads). Rows with equal settings share ``choose``'s device work and one host draw."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None

    @classmethod
    def of(cls, config) -> "RowSettings":
        """A config's draw (GenerationConfig's names); every greedy row gets the one greedy setting."""
        if not config.do_sample:
            return cls()
        return cls(True, config.temperature, config.top_k, config.top_p, config.min_p, config.seed)


def process(ops, scores, seen=None, penalty: float = 1.0, mask=None):
    """The processors every strategy applies, in HF's order: the repetition ``penalty`` over the
    tokens ``seen`` ((B, V) bool, None: no penalty), then -inf where ``mask`` ((1, V) or (B, V) bool:
    the stop ids before the minimum length; None: none)."""
    if seen is not None:
        scores = processors.repetition_penalty(ops, scores, seen, penalty)
    if mask is not None:
        scores = processors.masked(ops, scores, mask)
    return scores


def choose(ops, scores, settings: Sequence[RowSettings], steps, noise_rows, vocab_size: int, rows=None) -> np.ndarray:
    """(B,) host int64 next tokens from processed float32 ``scores`` (B, V), row r drawn with
    ``settings[r]``: greedy rows share one ``argmax``; seeded rows hand their candidates (their top-k,
    one ``topk`` per distinct k, or the whole vocabulary) to the host, where rows of equal settings
    draw together with ``noise.sample_candidates`` keyed by (seed, ``noise_rows[r]``, ``steps[r]``).
    ``rows``: the rows to choose for (default all; the others stay 0)."""
    batch = len(settings)
    tokens = np.zeros(batch, dtype=np.int64)
    steps, noise_rows = np.asarray(steps, dtype=np.int64), np.asarray(noise_rows, dtype=np.int64)
    groups: Dict[RowSettings, List[int]] = {}
    for row in range(batch) if rows is None else rows:
        groups.setdefault(settings[row], []).append(row)
    by_k: Dict[int, list] = {}
    for setting, members in groups.items():
        if not setting.do_sample:
            argmax = ops.to_numpy(ops.argmax(scores, axis=-1)).reshape(-1)
            tokens[members] = argmax[members]
        else:
            by_k.setdefault(setting.top_k, []).append((setting, members))
    for k, parts in by_k.items():
        members = [row for _, part in parts for row in part]
        picked = scores if members == list(range(batch)) else ops.take(scores, np.asarray(members), 0)
        if k:
            values, indices = ops.topk(picked, min(k, vocab_size))
            values, indices = ops.to_numpy(values), ops.to_numpy(indices)
        else:
            values = ops.to_numpy(picked)
            indices = np.broadcast_to(np.arange(values.shape[1]), values.shape)
        at = 0
        for setting, part in parts:
            here = slice(at, at + len(part))
            at += len(part)
            tokens[part] = sample_candidates(values[here], indices[here], setting, steps[part], noise_rows[part])
    return tokens


class SampledRow(NamedTuple):
    """One row of a batch with its own settings (the engine's): its draw, the noise key (``step``,
    ``noise_row``), its repetition ``penalty`` with the (1, V) device bool of the ids it has ``seen``
    (None without a penalty), and the ids ``masked`` this step (min tokens: its stop ids)."""

    settings: RowSettings
    step: int
    noise_row: int
    penalty: float = 1.0
    seen: Any = None
    masked: Tuple[int, ...] = ()


def select_rows(ops, scores, batch: Sequence[SampledRow], vocab_size: int, rows=None) -> np.ndarray:
    """(B,) host int64 tokens for rows that each have their own settings (``batch``), with the math of
    ``TokenSelector``: ``process`` then ``choose``. Rows that need no processing choose from ``scores``
    as they are; the others are processed together per distinct penalty (their seen masks and
    min-token masks stacked). ``rows``: the rows to choose for (default all)."""
    rows = list(range(len(batch))) if rows is None else list(rows)
    settings = [row.settings for row in batch]
    steps = [row.step for row in batch]
    noise_rows = [row.noise_row for row in batch]
    plain = [r for r in rows if batch[r].penalty == 1.0 and not batch[r].masked]
    tokens = choose(ops, scores, settings, steps, noise_rows, vocab_size, plain) if plain else None
    tokens = np.zeros(len(batch), dtype=np.int64) if tokens is None else tokens
    by_penalty: Dict[float, List[int]] = {}
    for r in rows:
        if batch[r].penalty != 1.0 or batch[r].masked:
            by_penalty.setdefault(batch[r].penalty, []).append(r)
    for penalty, part in by_penalty.items():
        picked = ops.take(scores, np.asarray(part), 0)
        seen = None
        if penalty != 1.0:
            seen = batch[part[0]].seen if len(part) == 1 else ops.concat([batch[r].seen for r in part], 0)
        mask = None
        if any(batch[r].masked for r in part):
            host = np.zeros((len(part), vocab_size), dtype=bool)
            for i, r in enumerate(part):
                host[i, [t for t in batch[r].masked if 0 <= t < vocab_size]] = True
            mask = ops.asarray(host, "bool")
        processed = process(ops, picked, seen, penalty, mask)
        pick = [settings[r] for r in part]
        drawn = choose(ops, processed, pick, [steps[r] for r in part], [noise_rows[r] for r in part], vocab_size)
        tokens[part] = drawn
    return tokens


class TokenSelector:
    """Turns one step's float32 scores (B, V) into next tokens (B,) on the host.

    ``seed=None`` follows HF op for op on the device (bit-identical scores, HF's multinomial);
    ``seed=<int>`` hands the top-k candidates to the portable host sampler (noise.py), keyed by
    the global row (``row_offset`` + row), so data-parallel ranks never draw the same noise.
    """

    def __init__(self, ops, config: GenerationConfig, prompt, vocab_size: int, row_offset: int = 0):
        self.ops = ops
        self.config = config
        self.settings = RowSettings.of(config)
        self.vocab_size = vocab_size
        batch = prompt.batch_size
        self.batch_size = batch
        self.row_offset = row_offset  # this batch's first global row (data-parallel ranks): seeded noise key
        self.keep_scores = bool(config.output_scores or config.output_logprobs)
        self.last_scores = None
        self.last_wide_scores = None  # last_scores recomputed from float64 logits (select's ``wide``)
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
        cfg = self.config
        mask = self._eos_mask if step < cfg.min_new_tokens else None
        scores = process(self.ops, scores, self._seen, cfg.repetition_penalty, mask)
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
        """(B,) host int64 tokens: HF-exact framework-RNG sample (``seed=None``, from ``warped``, the
        warpers' output), else ``choose`` (greedy argmax, or the seeded host sample)."""
        ops, cfg = self.ops, self.config
        if cfg.do_sample and cfg.seed is None:
            return ops.to_numpy(ops.multinomial(ops.softmax(warped, axis=-1)))
        batch = self.batch_size
        rows = self.row_offset + np.arange(batch)
        return choose(ops, scores, [self.settings] * batch, np.full(batch, step), rows, self.vocab_size)

    def select(
        self, scores, step: int, input_ids_view=None, active: Optional[np.ndarray] = None, wide=None
    ) -> np.ndarray:
        """(B,) host int64 tokens; ``active`` (B,) bool: the rows still running (the only ones whose
        non-finite scores raise; None = all). With ``keep_scores``, ``last_scores`` is the step's
        distribution as HF's ``output_scores`` reports it: after the processors, and after the
        warpers when sampling (on the device, also on the seeded path, whose draw warps on the host).
        ``wide``: the step's float64 logits (a float64 model), from which ``last_wide_scores`` is
        recomputed (the tokens are still chosen from the float32 ``scores``, as HF chooses them)."""
        cfg = self.config
        processed = self.process(scores, step, input_ids_view)
        sums = processors.row_sums(self.ops, processed)
        if cfg.do_sample:
            # before the draw: the framework's multinomial raises (torch) or picks silently (MindSpore) on
            # NaN, and the host sampler would warn
            self._check_finite(processed, sums, step, active)
            warped = self.warp(processed) if (self.keep_scores or cfg.seed is None) else None
            self.last_scores = warped
            self.last_wide_scores = self._widened(wide)
            return self._draw(processed, warped, step).astype(np.int64).reshape(-1)
        tokens = self._draw(processed, None, step)  # argmax cannot fail: its sync first, then the check's small copy
        self._check_finite(processed, sums, step, active)
        self.last_scores = processed
        self.last_wide_scores = self._widened(wide)
        return tokens.astype(np.int64).reshape(-1)

    def _widened(self, wide):
        """``last_scores`` computed from the float64 logits ``wide`` (None without them): the repetition
        penalty and the temperature in float64, -inf where the float32 chain cut a token (top-k / top-p /
        min-p / min_new_tokens), so the float64 distribution has the support the token was drawn from.
        A user's ``logits_processor`` runs once, on the float32 scores: then its result, cast."""
        if wide is None or not self.keep_scores or self.last_scores is None:
            return None
        ops, cfg = self.ops, self.config
        if cfg.logits_processor:
            return ops.cast(self.last_scores, "float64")
        scores = wide
        if self._seen is not None:  # not yet marked with this step's tokens: observe() comes after
            scores = processors.repetition_penalty(ops, scores, self._seen, cfg.repetition_penalty)
        if cfg.do_sample and cfg.temperature != 1.0:
            scores = scores / cfg.temperature
        return ops.where(self.last_scores == NEG_INF, NEG_INF, scores)


def log_softmax(ops, x):
    """``ops.log_softmax(x, -1)``, exact in float64: MindSpore CPU's float64 LogSoftmax rounds like
    float32 (3e-6 off on the demo model's logits), so float64 is ``x - max - log(sum(exp(x - max)))``,
    the log of the (..., 1) row sums taken on the host (the backends have no ``log``)."""
    if ops.dtype_name(x) != "float64":
        return ops.log_softmax(x, -1)
    shifted = x - ops.max(x, -1, keepdims=True)
    sums = ops.to_numpy(ops.sum(ops.exp(shifted), -1, keepdims=True))
    with np.errstate(divide="ignore"):
        return shifted - ops.asarray(np.log(sums), "float64")


def chosen_and_top_logprobs(ops, logits, tokens, k: int):
    """``log_softmax(logits)`` (B, V) at the (B, 1) device int64 ``tokens``, and its ``k`` largest
    values with their token ids (B, min(k, V)) (None, None for k = 0): vLLM's ``logprobs=k``, in the
    logits' dtype. generate's ``top_logprobs`` reads it; the engine's per-request logprobs are the same math."""
    logprobs = log_softmax(ops, logits)
    chosen = ops.take_along_axis(logprobs, tokens, -1)
    if not k:
        return chosen, None, None
    values, indices = ops.topk(logprobs, min(int(k), int(logits.shape[-1])))
    return chosen, values, indices


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
