"""What generate() needs to know about a model split across ranks, or shared by threads.

A model declares it with two attributes (the native Qwen3.5 ports set them under ``tp > 1``;
a user's own tensor-parallel model sets them the same way):

- ``parallel_group``: the process group its ranks share (``None`` or absent: not distributed);
- ``vocab_parallel``: True when each rank's logits hold only its slice of the vocabulary (equal
  blocks in rank order; ``vocab_size``, if set, trims the padding of the last block).

Before the first step every rank's inputs and config are compared with one small all-gather (a
32-bit digest per field), so a rank handed different prompts, settings, logits processors or
stopping criteria raises the same ``ValueError`` naming the fields everywhere, instead of hanging
or silently diverging. A streamer or ``on_tokens`` callback may be given on some ranks only (the
usual "rank 0 prints"): they run no collective, so they are not compared.

Every rank ends each step with the same tokens: greedy and ``seed=<int>`` draws are functions of
the gathered logits, the same on every rank; a ``seed=None`` draw uses each rank's own framework
RNG, whose states need not agree, so rank 0 of the group decides (:func:`agree_on_tokens`).

Threads: a backend whose framework cannot run two forwards at once (its ops say
``thread_safe = False``: MindSpore's PyNative runtime segfaults inside the kernels, on one model or
two) gets its ``generate`` calls serialised by :func:`exclusive`; torch runs them side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import weakref

import numpy as np

from hyper_gen import registry
from hyper_gen.config import GenerationConfig

_FOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> what its adapter found


def _declared_parallelism(ops, model):
    """(group, vocab_parallel): the model's own attributes, else what its backend finds in its
    parameters (torch: a DTensor-sharded output layer from ``parallelize_module``), else (None, False)."""
    if hasattr(model, "parallel_group"):
        return model.parallel_group, bool(getattr(model, "vocab_parallel", False))
    try:
        return _FOUND[model]
    except (KeyError, TypeError):
        pass
    found = registry.adapter(ops.name).find_parallelism(model) or (None, False)
    try:
        _FOUND[model] = found
    except TypeError:  # not weak-referenceable: look again next call
        pass
    return found


def parallel_group(ops, model):
    """(group, world size) when ``model`` is split across more than one rank, else (None, 1)."""
    group, _ = _declared_parallelism(ops, model)
    if group is None and not hasattr(model, "parallel_group"):
        return None, 1
    size = ops.world_size(group)
    return (group, size) if size > 1 else (None, 1)


def is_vocab_parallel(ops, model) -> bool:
    return _declared_parallelism(ops, model)[1]


def forward_is_collective(ops, model) -> bool:
    """True when every forward of ``model`` runs collectives with other data-parallel ranks, so ranks
    must keep stepping together: the model says so (``collective_forward = True``), or its backend
    finds FSDP / ZeRO-style sharding in it."""
    declared = getattr(model, "collective_forward", None)
    if declared is not None:
        return bool(declared)
    return bool(registry.adapter(ops.name).collective_forward(model))


def model_group_leader(ops, model) -> int:
    """The global rank of rank 0 of ``model``'s model-parallel group (itself when not model-parallel):
    ranks of one group share their prompts, so they count once among the data-parallel rows."""
    group, size = parallel_group(ops, model)
    me = ops.rank()
    if size == 1:
        return me
    mine = np.full((1, 1), float(me), dtype=np.float32)
    everyone = ops.to_numpy(ops.all_gather(ops.asarray(mine, "float32"), axis=0, group=group))
    return int(everyone.min())


def model_parameters_unsharded(ops, model, enabled: bool):
    """Context: ``model``'s sharded parameters gathered once for the whole call (FSDP2 ``unshard()``
    ... ``reshard()``), so decoding does not all-gather every layer every token; a no-op when not
    ``enabled`` or nothing is sharded. Costs the full parameters' memory on every rank meanwhile."""
    if not enabled:
        return contextlib.nullcontext()
    return registry.adapter(ops.name).parameters_unsharded(model)


def _callables(value):
    """A list of processors / criteria as what every rank can compare: how many, and what they are."""
    if value is None:
        return None
    return [getattr(f, "__qualname__", None) or type(f).__qualname__ for f in value]


def _fields(prompt, config, extra=()):
    """(name, bytes) of everything every rank must agree on before the first step. ``prompt`` None: a
    rank that refused its own input, which still sends one (empty) value per field."""
    yield "input_ids", b"" if prompt is None else repr(prompt.ids.shape).encode() + prompt.ids.tobytes()
    yield "attention_mask", b"" if prompt is None else repr(prompt.mask.shape).encode() + prompt.mask.tobytes()
    for field in dataclasses.fields(config if config is not None else GenerationConfig):
        value = None if config is None else getattr(config, field.name)
        if field.name in ("logits_processor", "stopping_criteria"):
            value = _callables(value)
        yield field.name, repr(value).encode()
    for name, data in extra:
        yield name, data


def _fingerprint(prompt, config, extra=(), failed=False):
    """(field names, (1, 1 + 2 * fields) float32): a refused-input flag, then each field's 32-bit digest
    as two 16-bit words (exact in float32, which every collective carries)."""
    names, words = [], [np.array([1 if failed else 0], dtype=np.uint16)]
    for name, data in _fields(prompt, config, extra):
        names.append(name)
        words.append(np.frombuffer(hashlib.sha256(data).digest()[:4], dtype=np.uint16))
    return names, np.concatenate(words).astype(np.float32)[None, :]


class InconsistentInputs(ValueError):
    """The ranks of a model-parallel group were given different inputs or config; ``fields`` names them."""

    def __init__(self, message: str, fields=()):
        super().__init__(message)
        self.fields = tuple(fields)


def check_consistent_inputs(ops, model, prompt, config, *, extra=(), error=None, caller="generate()") -> None:
    """Every rank of ``model``'s model-parallel group has the same inputs and config, or every rank
    raises a ``ValueError`` naming the fields and ranks (one small all-gather; nothing when the model
    is not split; an :class:`InconsistentInputs`, whose ``fields`` say which). ``extra``: more
    (name, bytes) fields, the same names on every rank.

    ``error``: this rank refused its own input before the exchange (``prompt`` / ``config`` may then be
    None); it still joins the all-gather, so the others raise a ``ValueError`` naming it instead of
    waiting for it in a collective, and re-raises ``error``."""
    group, size = parallel_group(ops, model)
    if size == 1:
        if error is not None:
            raise error
        return
    names, mine = _fingerprint(prompt, config, extra, failed=error is not None)
    everyone = ops.to_numpy(ops.all_gather(ops.asarray(mine, "float32"), axis=0, group=group))
    refused = [int(r) for r in np.flatnonzero(everyone[:, 0])]
    if error is not None:
        raise error
    if refused:
        raise ValueError(
            f"{caller} refused the input of rank(s) {refused} of the {size}-rank model group before any forward "
            "(that rank raised why), so every rank stops"
        )
    per_field = everyone[:, 1:].reshape(everyone.shape[0], len(names), 2)
    differs = (per_field != per_field[:1]).any(axis=2)  # (ranks, fields) against rank 0
    if differs.any():
        fields = [name for i, name in enumerate(names) if differs[:, i].any()]
        ranks = [r for r in range(differs.shape[0]) if differs[r].any()]
        raise InconsistentInputs(
            f"{caller} was called with different {', '.join(fields)} on rank(s) {ranks} than on rank 0 of the "
            f"{size}-rank model group; every rank must get the same inputs and config (logits_processor and "
            "stopping_criteria: the same number of the same callables)",
            fields,
        )


def gather_vocab_logits(ops, model, logits):
    """Full-vocabulary logits (B, V) from a vocab-sharded model's local slice; else unchanged (logits
    that came back as a distributed tensor were made whole by ``drivers.logits_of``)."""
    if not is_vocab_parallel(ops, model):
        return logits
    group, size = parallel_group(ops, model)
    if size == 1:
        return logits
    gathered = ops.all_gather(logits, axis=-1, group=group)
    vocab_size = getattr(model, "vocab_size", None)  # the shards may be padded to a multiple of tp
    return gathered[..., :vocab_size] if vocab_size and gathered.shape[-1] > vocab_size else gathered


def agree_on_tokens(ops, model, config, tokens: np.ndarray) -> np.ndarray:
    """Rank 0's (B,) tokens on every rank of a multi-rank model whose draw used the framework RNG.

    A ``seed=None`` sample draws with each rank's own RNG (``torch.manual_seed(1234 + rank)`` is a
    legitimate setup), so the ranks would feed different tokens to their next forward. Rank 0 of
    the group decides, with one small all-reduce per step, the others adding zeros: an all-reduce
    names no source rank, so it is right for any group (a broadcast's ``src`` is a global rank in
    torch). The ids travel as two 16-bit words each in float32 (exact; MindSpore's CPU AllReduce
    carries only floats). Greedy and seeded draws are deterministic in the gathered logits: no traffic.
    """
    if not config.do_sample or config.seed is not None:
        return tokens
    group, size = parallel_group(ops, model)
    if size == 1:
        return tokens
    ids = tokens.astype(np.int64).reshape(-1)
    words = np.stack([ids >> 16, ids & 0xFFFF]).astype(np.float32)  # (2, B), each word < 2**16: exact
    if ops.rank(group) != 0:
        words = np.zeros_like(words)
    summed = ops.to_numpy(ops.all_reduce(ops.asarray(words, "float32"), "sum", group=group)).astype(np.int64)
    return (summed[0] * 65536 + summed[1]).reshape(tokens.shape)


_LOCKS: dict = {}  # ops class -> the lock its generate() calls take
_LOCKS_GUARD = threading.Lock()


def exclusive(ops, model):
    """A context in which this thread alone runs generate() on the backend of ``ops``, when its ops
    declare ``thread_safe = False``; a no-op elsewhere. The lock is per framework, not per model:
    MindSpore's PyNative executor is process-wide, and two threads on two different models crash
    it as surely as on one. Re-entrant (a callback may call generate again on the same thread)."""
    if getattr(ops, "thread_safe", True):
        return contextlib.nullcontext()
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(type(ops), threading.RLock())
