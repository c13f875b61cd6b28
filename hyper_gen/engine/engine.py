"""Engine: in-flight batching behind a thread-safe request API (the server and offline jobs stand on it).

The facade over one ``EngineCore`` (core.py) and, on rank 0, its ``OutputProcessor``
(output_processor.py): it checks what a caller gives (a request the engine cannot take is a
``ValueError`` / ``TypeError`` before anything is queued), turns each call into a message on the
core's one queue (messages.py) and waits for its answer, or hands back the request's stream. The
core applies the messages at a step boundary and runs the steps: on its own thread (``start()``),
on the caller's (``start(background=False)`` and ``step()``), and on the other ranks of a
tensor-parallel engine in ``run_follower``; the output processor turns what they draw into text,
chunks and outputs. Nothing here touches the batch or the text.
"""

from __future__ import annotations

import json
import math
import secrets
import uuid
from typing import List, Optional, Sequence

from ..registry import backend_for, thread_initializer
from .checks import check_engine_model, check_prompt_ids, check_request, model_limits
from .config import EngineConfig, resolve_engine_config
from .core import EngineCore, EngineDeadError
from .messages import (
    ALL,
    PAUSE_MODES,
    Abort,
    AddRequest,
    FlushCache,
    JoinWeightGroup,
    LeaveWeightGroup,
    Pause,
    ReceiveWeights,
    Resume,
    Sleep,
    WakeUp,
)
from .output_processor import OutputProcessor
from .params import SamplingParams
from .request import Request
from .stream import RequestStream
from .weight_sync import version_key


def _seconds(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {value!r}")
    return float(value)


class _LazyGrammar:
    """The runner's view of the engine's grammar backend, built when a constrained row first draws."""

    def __init__(self, engine):
        self._engine = engine

    def mask(self, ops, scores, choices, rows):
        """``scores`` with each constrained row's grammar applied, its matcher advanced to the choice's tokens."""
        backend = self._engine.grammar_backend()
        pairs = []
        for row in rows:
            choice = choices[row]
            choice.grammar = backend.advance(choice.grammar, choice.request.params.structured_outputs, choice.token_ids)
            pairs.append((choice.grammar[0], row))
        return backend.mask(ops, scores, pairs)


class Engine:
    """In-flight batching engine over one model (see the module docstring).

    ``tokenizer``: any HF tokenizer, for chunk text and stop strings (None: ids only). The settings
    come as an ``EngineConfig`` (``config``; config.py documents each, with vLLM's names) and/or as
    keywords, which override its fields: its names or the engine's older ``max_batch_size``
    (``max_num_seqs``) and ``cache_memory_bytes`` (``kv_cache_memory_bytes``); ``engine.config``
    holds them. The cache is paged (``scheduler.py``, ``runner.py``): one pool of blocks, whose size
    ``stats()`` and the server print.
    """

    def __init__(self, model, tokenizer=None, config: Optional[EngineConfig] = None, **overrides):
        check_engine_model(model)
        self.config = config = resolve_engine_config(config, overrides, stacklevel=3)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size = config.max_num_seqs
        self.admit_batch = min(config.admit_batch, self.max_batch_size)
        self.ops = backend_for(model)
        self.vocab_size, self.max_model_len, self.eos_token_ids = model_limits(model, config.max_model_len)
        self._core = core = EngineCore(
            model,
            self.ops,
            config,
            max_model_len=self.max_model_len,
            admit_batch=self.admit_batch,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
        )
        self.world_size, self.rank, self.cache_memory_bytes = core.world_size, core.rank, core.cache_memory_bytes
        self._grammar = None
        if tokenizer is not None:  # every rank: each runs its own matchers on the same tokens
            core.runner.grammar = _LazyGrammar(self)
        if self.rank == 0:  # text, stop strings, chunks and outputs, off the step loop (the other ranks stream nothing)
            stop = lambda choice: core.post(Abort(choice, reply=False))  # noqa: E731
            core.outputs = OutputProcessor(tokenizer, abort=stop, fail=core.fail)

    def grammar_backend(self):
        """The structured-outputs backend over this engine's tokenizer (built on first use; None without one)."""
        if self._grammar is None and self.tokenizer is not None:
            from ..grammar import GrammarBackend

            vocab = self.vocab_size or len(self.tokenizer)
            self._grammar = GrammarBackend(self.tokenizer, vocab, self.eos_token_ids)
        return self._grammar

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self, background: bool = True) -> "Engine":
        """Start the engine thread and the output processor's (rank 0 of a multi-rank model; the other
        ranks run ``run_follower``).

        ``background=False``: no thread; the caller drives the engine with :meth:`step` (offline jobs:
        no handoff between threads, whose two framework thread pools slow each other down on a small host)."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} of a multi-rank engine runs engine.run_follower(), not start()")
        # (setup: the caller's settings, torch's threads, on the engine thread)
        self._core.start(inline=not background, setup=thread_initializer(self.ops.name) if background else None)
        return self

    def step(self) -> bool:
        """One step on the calling thread, for an engine started with ``start(background=False)``:
        the queued messages, admissions, one token for every running row, drops; then the output
        processor's chunks and outputs (done callbacks run here). False when nothing
        is queued or running, or while the engine is paused (no forward runs then)."""
        if self._core.state != "new" and not self._core.inline:
            raise RuntimeError("this engine runs its own thread: step() is for start(background=False)")
        self._core.check_running()
        return self._core.step()

    def shutdown(self, timeout: Optional[float] = 60.0) -> None:
        """Stop: requests still queued or running end with finish_reason "abort"; the other ranks'
        ``run_follower`` returns. Waits up to ``timeout`` s for the engine thread (and as long for every
        stream to be closed)."""
        message = self._core.stop()
        if self._core.inline and message is not None:
            self._core.drive(message)
        self._core.join(timeout)

    def run_follower(self) -> None:
        """Ranks other than 0 of a multi-rank model: run rank 0's steps until it shuts down."""
        self._core.follow()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def alive(self) -> bool:
        return self._core.state == "running"

    def stats(self) -> dict:
        """How busy the engine is and what its cache holds (a snapshot, read without the engine's
        lock): ``running`` requests admitted and not yet closed, ``waiting`` requests queued for a
        slot; ``blocks_total`` / ``blocks_used`` / ``blocks_cached`` / ``blocks_free`` of the pool,
        ``kv_cache_usage`` (used / total), ``prefix_cache_queries`` and ``prefix_cache_hits``
        (prompt tokens looked up / found cached, cumulative, as vLLM counts them),
        ``preemptions``, ``cache_memory_bytes``, ``block_size``, ``bytes_per_block`` (K and V of
        every attention layer for one block) and ``state_slot_bytes`` (a hybrid model's live Gated
        DeltaNet states, a slot per sequence: 0 without recurrent layers). A budget of N blocks is N
        times ``bytes_per_block`` plus ``state_slot_bytes``."""
        return self._core.stats()

    # ---- requests ------------------------------------------------------------------------
    def submit(self, prompt_token_ids, params: Optional[SamplingParams] = None, request_id: Optional[str] = None):
        """Queue a request; returns its ``RequestStream``. Thread-safe. Raises ``ValueError`` /
        ``TypeError`` for a request the engine cannot take, before it is queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = check_prompt_ids(prompt_token_ids, self.vocab_size)
        check_request(self, ids.size, params)
        if request_id is None:
            request_id = f"req-{uuid.uuid4().hex}"
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {request_id!r}")
        noise_seed = params.seed if params.seed is not None else secrets.randbits(63)
        request = Request(None, request_id, [int(t) for t in ids], params, noise_seed)
        request.stream = RequestStream(request_id, lambda: self._core.post(Abort(request, reply=False)))
        self._core.post(AddRequest(request=request))
        return request.stream

    async def generate(self, prompt_token_ids, params: Optional[SamplingParams] = None, request_id=None):
        """``async for chunk in engine.generate(ids, params)``; leaving the loop early cancels the request."""
        stream = self.submit(prompt_token_ids, params, request_id)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()

    def run_batch(self, requests, return_exceptions: bool = False) -> list:
        """``[(prompt_token_ids, params), ...]`` through the in-flight queue at once; ``RequestOutput``s
        in input order. ``return_exceptions``: a request that fails (or is refused) gives its
        exception in its place instead of raising. Starts (and then stops) the engine if needed."""
        started_here = self._core.state == "new" and self.rank == 0
        if started_here:
            self.start()
        try:
            streams: List = []
            for prompt, params in requests:
                try:
                    streams.append(self.submit(prompt, params))
                except (TypeError, ValueError) as error:
                    if not return_exceptions:
                        for stream in streams:
                            stream.cancel()
                        raise
                    streams.append(error)
            results = []
            for stream in streams:
                try:
                    results.append(stream if isinstance(stream, BaseException) else stream.result())
                except Exception as error:
                    if not return_exceptions:
                        raise
                    results.append(error)
            return results
        finally:
            if started_here:
                self.shutdown()

    # ---- controls: an RL trainer's, between rollouts (verl, SGLang and vLLM use these names) -------
    def abort_all(self) -> list:
        """End every unfinished request at the next step boundary and return their ``RequestOutput``s
        (submission order): the tokens and logprobs decoded so far, finish_reason "abort" on each
        choice still running (a choice that had ended keeps its reason). Queued requests end too,
        with no tokens. Their streams end cleanly: a last chunk, then the output (no exception)."""
        return self._core.call(Abort(ALL))

    def abort(self, request_id: str):
        """``abort_all`` for one request: its ``RequestOutput``, or None when it had already finished
        (a no-op; an id counts as finished for the last 100,000 requests that ended). An id never
        submitted is a ValueError. Request ids are the caller's: every unfinished request with this
        id ends, and the first submitted one's output is returned."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        outputs = self._core.call(Abort(request_id))
        return outputs[0] if outputs else None

    def pause(self, mode: str = "abort") -> list:
        """Stop scheduling at the next step boundary; returns once no step runs (weights may then
        change under the model). ``mode="abort"``: every unfinished request ends as with
        ``abort_all`` (their outputs are returned); ``"keep"``: running requests keep their rows and
        cache, and continue on ``resume()`` with exactly the tokens of an uninterrupted run
        (returns []). While paused ``submit`` queues (admitted after ``resume``), ``abort`` and
        ``cancel`` still end requests, and an engine stepped by the caller runs no forward: its
        ``step()`` returns False."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got mode={mode!r}")
        return self._core.call(Pause(mode))

    def resume(self) -> None:
        """Continue scheduling after ``pause``: kept rows decode on, queued requests are admitted.
        A no-op when the engine is not paused."""
        if self._core.pausing():
            self._core.call(Resume())

    def update_weights(self, weights, version=None) -> int:
        """``hyper_gen.update_weights`` on the engine's model at the next step boundary; returns the
        number of tensors applied. Every ``RequestOutput`` made after it carries ``weight_version =
        version``. Running requests continue on the new weights from their next token (vLLM's
        semantics: the cache they built keeps the old weights' keys and values); ``pause(mode="keep")``
        first and ``resume()`` after to apply it between rollouts instead. The tensors are checked in
        the calling thread (a ValueError / TypeError naming the tensor, nothing queued), converted and
        written between two steps; an error there raises here and changes nothing.

        On a multi-rank (tensor-parallel) engine this is a collective, like a torch.distributed call:
        call it on every rank, in the same order, with the same ``version`` and the same tensor names
        (the full HF-named tensors on each rank; a DTensor is made whole), on rank 0 from another
        thread than the engine's, elsewhere from another thread than the one in ``run_follower``.
        The update lands on every rank or on none, and no wait is unbounded: a rank waits
        ``update_timeout_s`` for its peers' calls (weight_sync.py says what each rank raises when a
        tensor, a conversion or a peer fails: a ValueError naming the rank on every rank)."""
        return self._core.call(self._core.weights.message(self.model, weights, version))

    # ---- a trainer's weight-update group (SGLang's calls): every rank at one boundary ------------
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> None:
        """Join a trainer's torch.distributed group ``group_name`` at ``tcp://master_address:master_port``
        (the trainer is its rank 0 and hosts the rendezvous): this engine's ranks are ``rank_offset``
        .. ``rank_offset + world_size_of_the_engine - 1`` of ``world_size`` (SGLang's semantics).
        Called on rank 0 only; every rank joins at the next step boundary (``weight_groups.py``), or
        none does. A trainer that does not come within ``timeout_s`` is a TimeoutError; a model whose
        backend cannot join a torch group (MindSpore) a ValueError."""
        if not isinstance(master_port, int) or not 0 < master_port < 65536:
            raise ValueError(f"master_port must be a port number, got {master_port!r}")
        if not isinstance(world_size, int) or not isinstance(rank_offset, int):
            raise TypeError(f"rank_offset and world_size must be ints, got {rank_offset!r} and {world_size!r}")
        if not 1 <= rank_offset or rank_offset + self.world_size > world_size:
            raise ValueError(
                f"this engine's {self.world_size} rank(s) take ranks rank_offset .. rank_offset + "
                f"{self.world_size - 1} of world_size={world_size}, rank 0 being the trainer's: got "
                f"rank_offset={rank_offset}"
            )
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"group_name must be a non-empty str, got {group_name!r}")
        spec = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset)
        spec.update(world_size=world_size, group_name=group_name, backend=backend, timeout_s=_seconds(timeout_s))
        self._core.call(JoinWeightGroup(spec=spec))

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        version=None,
        flattened: bool = False,
        timeout_s: float = 300.0,
        drop: bool = False,
    ) -> int:
        """Receive the tensors ``names`` (of ``dtypes`` and ``shapes``) from rank 0 of the group
        ``group_name``, in that order (one broadcast each, or with ``flattened`` SGLang's
        ``flattened_bucket``: one broadcast of them all flattened and concatenated, one dtype), on every
        rank at the next step boundary, and apply them as one ``update_weights(weights, version)``
        (each rank keeps its shard; all or nothing); returns the number of tensors written. ``drop``:
        receive and discard them (an update refused after the trainer started sending). A broadcast
        that does not come within ``timeout_s`` is a TimeoutError, and the group is destroyed on every
        rank (join it again)."""
        names, dtypes = [str(n) for n in names], [str(d) for d in dtypes]
        shapes = [[int(d) for d in shape] for shape in shapes]
        if not names or len({len(names), len(dtypes), len(shapes)}) != 1:
            raise ValueError(
                f"names, dtypes and shapes need one item per tensor, got {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        if flattened and len(set(dtypes)) != 1:
            raise ValueError(f"a flattened bucket carries one dtype, got {sorted(set(dtypes))}")
        spec = dict(group_name=group_name, names=names, dtypes=dtypes, shapes=shapes, flattened=bool(flattened))
        spec.update(drop=bool(drop), timeout_s=_seconds(timeout_s), version=json.loads(version_key(version)))
        return self._core.call(ReceiveWeights(spec=spec, version=version))

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the group ``group_name`` on every rank (a ValueError if this engine is not in it)."""
        self._core.call(LeaveWeightGroup(spec={"group_name": group_name}))

    @property
    def weight_groups(self) -> tuple:
        """The names of the trainers' weight-update groups this engine is in."""
        return self._core.groups.names

    @property
    def update_timeout_s(self) -> float:
        """How long this rank waits for its peers' update_weights calls (multi-rank; read live)."""
        return self._core.weights.timeout_s

    @update_timeout_s.setter
    def update_timeout_s(self, seconds: float) -> None:
        self._core.weights.timeout_s = seconds

    def sleep(self, abort: bool = False) -> list:
        """Free the KV cache pool and the prefix cache, at the next step boundary (between a rollout
        and a training step: vLLM's sleep mode, SGLang's ``release_memory_occupation``). The engine
        must be idle: with requests running or queued it raises RuntimeError, unless ``abort=True``,
        which ends them first as ``abort_all`` does (their outputs are returned). While asleep
        ``submit`` raises RuntimeError; ``wake_up()`` allocates the pool again (the prefix cache
        starts empty). A no-op when already asleep."""
        if not isinstance(abort, bool):
            raise TypeError(f"abort must be a bool, got {abort!r}")
        return self._core.call(Sleep(abort=abort))

    def flush_cache(self) -> int:
        """Drop every cached prefix at the next step boundary (SGLang's ``flush_cache``); returns the
        number of cached blocks dropped. Refused (RuntimeError) while requests run or wait."""
        return self._core.call(FlushCache())

    def wake_up(self) -> None:
        """Allocate the KV cache pool again after ``sleep()`` (a no-op when awake)."""
        self._core.call(WakeUp())

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine's cache pool is released (``sleep()``)."""
        return self._core.asleep

    @property
    def weight_version(self):
        """The ``version`` of the last ``update_weights`` applied (None before any)."""
        return self._core.weight_version

    @property
    def paused(self) -> bool:
        """Whether the engine is paused (a snapshot, read without the engine's lock)."""
        return self._core.paused

    # the core's scheduler and runner (what checks.py and the benchmarks read)
    _scheduler = property(lambda self: self._core.scheduler)
    _runner = property(lambda self: self._core.runner)


__all__ = ["Engine", "EngineDeadError", "check_engine_model"]
