"""``generate()``: prefill once, then one token per row per step until every row stops.

The loop is framework-free: the model driver (drivers.py) feeds the model, the selector
(sampling.py) picks tokens on the device, and the host keeps the bookkeeping (which rows are
finished, what to stream, the output). Tokens come to the host once per step, the one sync HF's
loop also makes, because stopping and streaming need them there.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .config import GenerationConfig, resolve_config
from .drivers import make_driver
from .grammar import RowGrammars
from .inputs import ModelLimits, check_against_model, check_rows, check_vocabulary, prepare_prompts
from .outputs import RoutedExperts, StepRecorder
from .parallel.model_group import (
    InconsistentInputs,
    agree_on_tokens,
    check_consistent_inputs,
    exclusive,
    forward_is_collective,
    gather_vocab_logits,
    model_group_leader,
    model_parameters_unsharded,
)
from .parallel.step_sync import RankFailed, StepSync
from .registry import backend_for
from .sampling import TokenSelector, apply_stopping_criteria
from .stop_strings import StopStrings

OnTokens = Callable[[int, np.ndarray, np.ndarray], Any]


def generate(
    model,
    input_ids,
    generation_config: Optional[GenerationConfig] = None,
    attention_mask=None,
    *,
    streamer=None,
    on_tokens: Optional[OnTokens] = None,
    tokenizer=None,
    structured_outputs=None,
    **config_overrides,
):
    """Generate continuations of left-padded prompts with ``model``.

    ``input_ids`` / ``attention_mask``: a framework tensor, numpy array or list of lists (1 =
    real token, 0 = left padding; None = no padding). Keyword overrides update the config
    (``generate(model, ids, max_new_tokens=8)``). ``streamer``: HF streamer protocol
    (``put(ids)``, ``end()``). ``on_tokens(step, token_ids (B,), finished (B,))``: called after
    every step with host arrays. ``tokenizer``: an HF tokenizer, needed by ``stop_strings`` and
    ``structured_outputs``: a grammar the generated tokens follow (vLLM's ``StructuredOutputsParams``
    names, a :class:`~hyper_gen.grammar.StructuredOutputs` or its dict, e.g. ``{"json": schema}``;
    one for every prompt or a list with one (or None) per prompt), masked into the scores before the
    processors, so greedy, HF's processors and the seeded sampler choose among what it allows.

    Returns an int64 tensor of the model's framework, (B * num_return_sequences, max_total_len):
    row i is its prompt without padding, its generated tokens (with the EOS that ended it), then
    ``pad_token_id``; with ``return_dict_in_generate=True`` a :class:`~hyper_gen.outputs.GenerateOutput`
    holding that as ``sequences`` (plus ``scores`` / ``logits`` / ``logprobs`` where asked).

    Bad input raises ``ValueError`` / ``TypeError`` naming the field and value before any forward
    where the model declares what is needed (``vocab_size``, ``max_position_embeddings``, on the
    model or its ``config``): token ids, pad / EOS ids outside the vocabulary (else checked on the
    first logits' width, before the first token is chosen), a prompt that fills the context. A
    row stops where its prompt + generated tokens fill the declared context. Scores that are NaN,
    +inf or all -inf in a running row raise at that step (sampling.py).

    Step-synced (``synced_gpus``, decided from the model when None: an FSDP / DTensor-sharded or
    ``collective_forward`` model in a multi-rank job): every rank keeps stepping until every rank
    is done, with the cache kept (parallel/step_sync.py); ``unshard_params=True`` all-gathers an
    FSDP model's parameters once for the whole call instead of in every forward.
    """
    if model is None or not callable(model):
        raise TypeError(f"model must be a callable model (torch.nn.Module / mindspore.nn.Cell), got {model!r}")
    ops = backend_for(model, input_ids)
    synced, prompt, config, loop, refused = _asked_synced(generation_config, config_overrides), None, None, None, None
    try:
        config = resolve_config(generation_config, config_overrides, model)
        synced = config.synced_gpus
        prompt = prepare_prompts(input_ids, attention_mask)
        check_rows(prompt, config)  # batch x num_return_sequences, before any row is allocated
        limits = ModelLimits.of(model)  # vocab_size / max_position_embeddings, where the model declares them
        check_against_model(prompt, config, limits)  # before any forward
        stops = None
        if config.stop_strings:
            stops = StopStrings(config.stop_strings, tokenizer, prompt.take(_repeat_rows(prompt, config)))
        grammars = None
        if structured_outputs is not None:
            vocab = limits.vocab_size or (len(tokenizer) if tokenizer is not None else 0)
            rows = _repeat_rows(prompt, config)
            grammars = RowGrammars.build(
                structured_outputs, tokenizer, vocab, config.eos_token_ids, prompt.batch_size, rows
            )
        # the driver's own checks (a padded prompt for a forward without attention_mask) before the exchange too
        loop = _DecodeLoop(model, ops, prompt, config, ops.param_dtype(model), limits, None, stops, grammars)
    except Exception as error:
        refused = error
    # Before any forward, every rank learns whether every rank may go on (a rank that raised alone would
    # leave the others waiting in a collective): first a model-parallel group compares its ranks' inputs
    # (one all-gather of fixed size, whatever each rank's own call was; a rank that refused its input
    # joins it flagged), then a step-synced job exchanges the verdicts. Nothing when the world is one rank.
    try:
        check_consistent_inputs(ops, model, prompt, config, error=refused)  # raises ``refused`` itself
    except Exception as error:
        refused = error
    sync = None
    mixed = isinstance(refused, InconsistentInputs) and "synced_gpus" in refused.fields  # not every rank syncs
    if not mixed:
        sync = _step_sync(ops, model, synced)
    if sync is not None:
        sync.start(refused, 0 if refused is not None else prompt.batch_size * config.num_return_sequences)
    if refused is not None:
        raise refused
    loop.sync = sync
    with exclusive(ops, model), ops.no_grad():  # one thread at a time where the framework needs it
        with model_parameters_unsharded(ops, model, config.unshard_params):
            return loop.run(streamer, on_tokens)


def _asked_synced(generation_config, overrides) -> Optional[bool]:
    """``synced_gpus`` as the caller gave it, read without validating the rest of the config."""
    value = overrides.get("synced_gpus", getattr(generation_config, "synced_gpus", None))
    return value if isinstance(value, bool) else None


def _step_sync(ops, model, synced: Optional[bool]) -> Optional[StepSync]:
    """The step-sync collectives when this call must keep every rank stepping, else None."""
    if ops.world_size() == 1:
        return None
    if synced is None:
        synced = forward_is_collective(ops, model)
    return StepSync(ops, model_group_leader(ops, model)) if synced else None


def _repeat_rows(prompt, config) -> np.ndarray:
    return np.repeat(np.arange(prompt.batch_size), config.num_return_sequences)


class _DecodeLoop:
    """One generate call's host state: which rows run, what was generated, what to report."""

    def __init__(self, model, ops, prompt, config, dtype, limits, sync, stops, grammars=None):
        self.model, self.ops, self.config, self.sync, self.stops = model, ops, config, sync, stops
        self.grammars = grammars
        # per row: max_new_tokens, or fewer where the model's context ends (a row stops there)
        room = limits.new_token_room(prompt, config.max_new_tokens)
        self.steps = int(room.max())
        rows = _repeat_rows(prompt, config)
        self.room, self.capped = room[rows], (room < config.max_new_tokens)[rows]
        self.prompt = prompt
        self.limits = limits
        self.driver = make_driver(model, ops, prompt, _for_steps(config, self.steps), dtype)
        self.in_forward = False
        self.routes = RoutedExperts(ops, model) if config.return_routed_experts else None

    def _forward(self, call, *args):
        self.in_forward = True
        result = call(*args)
        self.in_forward = False
        return result

    def run(self, streamer, on_tokens):
        try:
            return self._run(streamer, on_tokens)
        except RankFailed:
            raise
        except Exception as error:
            # between forwards, the other ranks wait at this step's exchange: tell them; inside a forward
            # they wait in its collectives, which the collective timeout ends
            if self.sync is not None and not self.in_forward:
                self.sync.fail(error)
            raise

    def _run(self, streamer, on_tokens):
        ops, config, driver, sync = self.ops, self.config, self.driver, self.sync
        eos = np.asarray(config.eos_token_ids, dtype=np.int64)
        pad = config.pad_token_id
        if streamer is not None:
            streamer.put(self.prompt.ids.copy())
        if self.routes is None:
            logits = self._forward(driver.prefill)
        else:
            logits, routes = self._forward(self.routes.forward, driver.prefill)
            self.routes.prefill(routes, self.prompt.mask, _repeat_rows(self.prompt, config))
        prompt = driver.prompt  # each row num_return_sequences times
        batch = prompt.batch_size
        needs_ids = bool(config.logits_processor or config.stopping_criteria)
        ids_view = ops.asarray(prompt.ids, "int64") if needs_ids else None
        unfinished = np.ones(batch, dtype=bool)
        generated = np.empty((batch, min(self.steps, 256)), dtype=np.int64)  # grows as steps happen
        new_counts = np.zeros(batch, dtype=np.int64)
        recorder = StepRecorder(ops, config) if config.return_dict_in_generate else None
        selector = None
        done_here = False  # this rank's rows are all finished (step-synced ranks keep stepping)
        step = 0
        while True:
            if not done_here:
                full = gather_vocab_logits(ops, self.model, logits[:, -1])
                raw = ops.cast(full, "float32")  # tokens are chosen from float32 scores, as HF chooses them
                # a float64 model's logprobs come from its float64 logits
                wants_wide = recorder is not None and recorder.wants_wide
                wide = full if wants_wide and ops.dtype_name(full) == "float64" else None
                if selector is None:
                    if self.limits.vocab_size is None:  # undeclared: the logits tell, before the first token
                        check_vocabulary(prompt, config, int(raw.shape[-1]), "the width of its logits")
                    elif int(raw.shape[-1]) < self.limits.vocab_size:  # the same width on every rank: all raise
                        raise ValueError(
                            f"the model's logits are {int(raw.shape[-1])} wide but its vocab_size is "
                            f"{self.limits.vocab_size}: tokens past the width could never be chosen (an output "
                            "layer split by vocabulary unevenly across ranks loses the remainder: HyperParallel's "
                            "shard_module splits dim 0 evenly only)"
                        )
                    offset = sync.row_offset if sync is not None else 0
                    selector = TokenSelector(ops, config, prompt, int(raw.shape[-1]), row_offset=offset)
                    selector.keep_scores = recorder is not None and (config.output_scores or config.output_logprobs)
                chosen_from = raw if self.grammars is None else self.grammars.mask(ops, raw, unfinished)
                tokens = selector.select(chosen_from, step, ids_view, unfinished, wide=wide)
                tokens = agree_on_tokens(ops, self.model, config, tokens)  # framework-RNG draws: rank 0's
                tokens = np.where(unfinished, tokens, pad)
                if self.grammars is not None:
                    self.grammars.observe(tokens, unfinished)
                if step == generated.shape[1]:
                    generated = _widen(generated, self.steps)
                generated[:, step] = tokens
                new_counts += unfinished
                if self.capped.any():
                    unfinished &= ~(self.capped & (new_counts >= self.room))
                tokens_device = ops.asarray(tokens[:, None], "int64")
                selector.observe(tokens_device)
                if recorder is not None:
                    recorder.record(raw, selector.last_scores, tokens_device, wide, selector.last_wide_scores)
                if needs_ids:
                    ids_view = ops.concat([ids_view, tokens_device], 1)
                running = unfinished.copy() if self.stops is not None else None  # before EOS ends rows
                if eos.size:
                    unfinished &= ~np.isin(tokens, eos)
                if running is not None:
                    unfinished &= ~self.stops.check(tokens, running)
                stop = apply_stopping_criteria(config.stopping_criteria, ids_view, raw, batch)
                if stop is not None:
                    unfinished &= ~stop
                if streamer is not None:
                    streamer.put(tokens.copy())
                if on_tokens is not None:
                    on_tokens(step, tokens.copy(), ~unfinished)
                done_here = not unfinished.any() or step + 1 == self.steps
            all_done = sync.step(not done_here) if sync is not None else done_here
            if all_done:
                break
            if done_here:
                self._forward(driver.dummy_step)  # keeps this rank's collectives paired with the others'
            elif self.routes is None:
                logits = self._forward(driver.decode, tokens, tokens_device)
                step += 1
            else:
                logits, routes = self._forward(self.routes.forward, driver.decode, tokens, tokens_device)
                # a cached step feeds one token per row; without a cache the whole sequence runs again
                self.routes.decode(routes, np.ones((batch, 1)) if driver.use_cache else driver.host_mask)
                step += 1
        if streamer is not None:
            streamer.end()
        sequences = ops.asarray(_assemble(prompt, generated, new_counts, pad), "int64")
        if recorder is None:
            return sequences
        routes = None if self.routes is None else self.routes.finish(prompt.mask, new_counts)
        return recorder.finish(sequences, prompt.lengths.copy(), new_counts.copy(), routes)


def _for_steps(config, steps: int):
    """The config the driver sizes its buffers (static cache, masks) from: at most ``steps`` tokens."""
    if steps == config.max_new_tokens:
        return config
    return config.replace(max_new_tokens=steps, min_new_tokens=min(config.min_new_tokens, steps))


def _widen(buffer: np.ndarray, limit: int) -> np.ndarray:
    """``buffer`` (B, n) with twice the columns (at most ``limit``), its contents kept."""
    wider = np.empty((buffer.shape[0], min(limit, 2 * buffer.shape[1])), dtype=buffer.dtype)
    wider[:, : buffer.shape[1]] = buffer
    return wider


def _assemble(prompt, generated, new_counts, pad) -> np.ndarray:
    """RFC output: [real prompt | generated (with its EOS) | pad] per row, common width."""
    lengths = prompt.lengths + new_counts
    out = np.full((prompt.batch_size, int(lengths.max())), pad, dtype=np.int64)
    for row in range(prompt.batch_size):
        real = prompt.real_tokens(row)
        out[row, : real.size] = real
        out[row, real.size : real.size + new_counts[row]] = generated[row, : new_counts[row]]
    return out
