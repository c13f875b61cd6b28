"""Validate a call's input_ids / attention_mask once, on the host, into a ``PromptBatch``, and
check them (with the config's pad / EOS ids) against what the model declares about itself."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .positions import cumsum_positions
from .registry import to_host

_INT64_MAX = np.iinfo(np.int64).max


class InputTypeError(TypeError, ValueError):
    """Input of the wrong kind (float token ids): a ``TypeError``, and a ``ValueError`` for callers
    that caught the ``ValueError`` earlier versions raised."""


@dataclass(frozen=True)
class PromptBatch:
    """Left-padded prompts on the host.

    ``ids`` (B, S) int64 with padding as given, ``mask`` (B, S) int64 (1 real, 0 padding),
    ``lengths`` (B,) real tokens per row, ``padded`` whether any row has padding.
    """

    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    padded: bool

    @property
    def batch_size(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def position_ids(self) -> np.ndarray:
        """Padding 0, real tokens 0, 1, 2, ... (HF: cumsum - 1, padding filled with 0)."""
        return cumsum_positions(self.mask)

    def real_tokens(self, row: int) -> np.ndarray:
        return self.ids[row, self.width - int(self.lengths[row]) :]

    def take(self, rows: np.ndarray) -> "PromptBatch":
        """The batch of rows ``rows`` (repeated, reordered), e.g. each prompt n times for n samples."""
        return PromptBatch(ids=self.ids[rows], mask=self.mask[rows], lengths=self.lengths[rows], padded=self.padded)


def _first(where: np.ndarray):
    """(row, column) of the first True of a 2-D bool array, row-major."""
    row, col = np.unravel_index(int(np.argmax(where)), where.shape)
    return int(row), int(col)


_TOKENIZE_FIRST = (
    "tokenize it first: batch = tokenizer(texts, padding=True, return_tensors='np') (padding_side='left'), "
    "then generate(model, batch['input_ids'], attention_mask=batch['attention_mask'])"
)


def _text_problem(name: str, value: Any) -> Optional[str]:
    """What to say when ``value`` is text, or a tokenizer's whole output, instead of token ids."""
    if isinstance(value, (str, bytes)):
        return f"{name} is a {type(value).__name__} ({_preview(value)}), not token ids: {_TOKENIZE_FIRST}"
    if isinstance(value, (list, tuple)) and value:
        first, kind = value[0], "strings"
        if isinstance(first, (list, tuple)) and first:
            first, kind = first[0], "lists of strings"
        if isinstance(first, (str, bytes)):
            return f"{name} is a {type(value).__name__} of {kind} ({_preview(value)}), not token ids: {_TOKENIZE_FIRST}"
    if hasattr(value, "keys") and hasattr(value, "__getitem__") and not hasattr(value, "shape"):
        try:
            keys = list(value.keys())
        except Exception:
            return None
        if "input_ids" in keys:  # a tokenizer's BatchEncoding (or a dict like it)
            return (
                f"{name} is a {type(value).__name__} with keys {keys}, not token ids: pass its 'input_ids' and "
                "'attention_mask': generate(model, batch['input_ids'], attention_mask=batch['attention_mask'])"
            )
    return None


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_TOKEN_ID_ARRAYS = ("input_ids", "sequences")  # generate's and score's token ids


def _as_2d_int(name: str, value: Any) -> np.ndarray:
    problem = _text_problem(name, value)
    if problem is not None:
        raise InputTypeError(problem)
    value = to_host(value)
    try:
        array = np.asarray(value)
    except Exception as exc:  # ragged lists and other junk
        raise ValueError(f"{name} must be a rectangular 2-D array of integers: {exc}") from None
    if array.dtype.kind in "USO" and any(isinstance(item, (str, bytes)) for item in array.reshape(-1)[:1].tolist()):
        raise InputTypeError(f"{name} holds strings ({_preview(value)}), not token ids: {_TOKENIZE_FIRST}")
    if array.dtype == object:
        raise ValueError(f"{name} must be a rectangular 2-D array of integers (rows of equal length)")
    if array.ndim == 1 and np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{name} must be 2-D (batch, sequence), got shape {array.shape}: one prompt is a batch of one row, "
            f"[ids] (or ids[None, :])"
        )
    if array.ndim != 2:
        raise ValueError(f"{name} must be 2-D (batch, sequence), got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {array.shape}")
    if array.dtype == bool and name == "attention_mask":
        array = array.astype(np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        if name in _TOKEN_ID_ARRAYS:  # float ids are the wrong kind of input (generate's and score's TypeError)
            raise InputTypeError(f"{name} must hold integers (token ids), got dtype {array.dtype}")
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    if np.issubdtype(array.dtype, np.unsignedinteger) and array.dtype.itemsize == 8:
        too_big = array > _INT64_MAX  # would wrap to negative in int64
        if too_big.any():
            row, col = _first(too_big)
            raise ValueError(f"{name}[{row}, {col}] = {int(array[row, col])} does not fit int64 (max {_INT64_MAX})")
    return array.astype(np.int64, copy=False)


def prepare_prompts(input_ids: Any, attention_mask: Any = None) -> PromptBatch:
    """Check the RFC input rules and return the host-side batch."""
    ids = _as_2d_int("input_ids", input_ids)
    negative = ids < 0
    if negative.any():
        row, col = _first(negative)
        value = int(ids[row, col])
        raise ValueError(f"input_ids must be non-negative token ids, got input_ids[{row}, {col}] = {value}")
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask = _as_2d_int("attention_mask", attention_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        if not np.isin(mask, (0, 1)).all():
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
    lengths = mask.sum(axis=1)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"attention_mask row {int(empty[0])} has no real token")
    # left padding only: once a row turns 1 it stays 1
    right_padded = np.flatnonzero((np.diff(mask, axis=1) < 0).any(axis=1))
    if right_padded.size:
        raise ValueError(
            f"attention_mask row {int(right_padded[0])} is right-padded (a 0 after a 1); "
            "hyper_gen expects left padding (tokenizer padding_side='left')"
        )
    return PromptBatch(ids=ids, mask=mask, lengths=lengths.astype(np.int64), padded=bool((mask == 0).any()))


def check_rows(prompt: PromptBatch, config) -> None:
    """Batch x ``num_return_sequences`` rows within ``hyper_gen.config.MAX_ROWS``, before any row is
    allocated (each gets its prompt copy, a cache row and host bookkeeping)."""
    from .config import MAX_ROWS

    rows = prompt.batch_size * config.num_return_sequences
    if rows > MAX_ROWS:
        raise ValueError(
            f"input_ids has {prompt.batch_size} rows x num_return_sequences={config.num_return_sequences} = {rows} "
            f"rows, more than hyper_gen.config.MAX_ROWS = {MAX_ROWS} in one call: split the batch across calls"
        )


# ---- what the model declares about itself ------------------------------------------------
def _declared(model, name: str) -> Optional[int]:
    """``model.<name>``, else ``model.config.<name>`` (HF composite configs: their text config);
    None unless a positive int."""
    value = getattr(model, name, None)
    if value is None:
        config = getattr(model, "config", None)
        text_config = getattr(config, "get_text_config", None)
        if callable(text_config):
            try:
                config = text_config()
            except Exception:  # a config object of another kind: use it as is
                pass
        value = getattr(config, name, None)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value <= 0:
        return None
    return int(value)


@dataclass(frozen=True)
class ModelLimits:
    """What a model declares: ``vocab_size`` (token ids are < it) and ``context`` (its
    ``max_position_embeddings``: positions are < it); None where it declares nothing."""

    vocab_size: Optional[int]
    context: Optional[int]

    @classmethod
    def of(cls, model) -> "ModelLimits":
        return cls(_declared(model, "vocab_size"), _declared(model, "max_position_embeddings"))

    def new_token_room(self, prompt: PromptBatch, max_new_tokens: int) -> np.ndarray:
        """(B,) the most tokens each row may generate: ``max_new_tokens``, and no more than fit the
        context with the row's prompt (prompt + generated <= ``context``: the row stops there)."""
        room = np.full(prompt.batch_size, max_new_tokens, dtype=np.int64)
        if self.context is not None:
            room = np.minimum(room, self.context - prompt.lengths)
        return room


def check_vocabulary(prompt: PromptBatch, config, vocab_size: int, source: str) -> None:
    """Every prompt id, ``pad_token_id`` and EOS id must be a token id (< ``vocab_size``).

    ``source`` says where the vocabulary size came from, for the message."""
    vocab = f"the model's vocabulary of {vocab_size} tokens ({source}; ids 0..{vocab_size - 1})"
    outside = prompt.ids >= vocab_size
    if outside.any():
        row, col = _first(outside)
        where = "" if prompt.mask[row, col] else " (a padding position: padding ids are fed to the model too)"
        raise ValueError(f"input_ids[{row}, {col}] = {int(prompt.ids[row, col])}{where} is not a token id of {vocab}")
    if config.pad_token_id >= vocab_size:
        raise ValueError(
            f"pad_token_id={config.pad_token_id} is not a token id of {vocab}: finished rows are fed it, "
            "so it must be one"
        )
    eos_outside = [e for e in config.eos_token_ids if e >= vocab_size]
    if eos_outside:
        raise ValueError(
            f"eos_token_id {eos_outside[0] if len(eos_outside) == 1 else eos_outside} is not a token id of "
            f"{vocab}: generation could never stop on it"
        )


def check_against_model(prompt: PromptBatch, config, limits: ModelLimits) -> None:
    """The checks that need only what the model declares, before any forward."""
    if limits.vocab_size is not None:
        check_vocabulary(prompt, config, limits.vocab_size, "vocab_size")
    if limits.context is not None:
        longest = int(np.argmax(prompt.lengths))
        length = int(prompt.lengths[longest])
        if length >= limits.context:
            raise ValueError(
                f"input_ids row {longest} has a prompt of {length} tokens, "
                f"{'longer than' if length > limits.context else 'as long as'} the model's context of "
                f"{limits.context} positions (max_position_embeddings), which leaves no room for any of the "
                f"max_new_tokens={config.max_new_tokens} new tokens: shorten the prompt to under "
                f"{limits.context} tokens (a row's prompt and generated tokens together fit the context; "
                "generation stops where it ends)"
            )
