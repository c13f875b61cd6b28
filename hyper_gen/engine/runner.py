"""The model runner: executes a ``SchedulerOutput`` on the paged pool and draws the next tokens.

Every rank runs it on the output rank 0's scheduler made, so it keeps only what the forwards need:
each sequence's block table (grown by the blocks the output names), the state slot it owns in the
store's live Gated DeltaNet state pool (a forward gathers its rows' states by slot and writes them
back in place, so rows come and go without moving the others'), and the choices that draw from each
sequence's logits. Before the forward it applies what the last step left (state snapshots saved,
partial blocks copied, prompts forked into their choices, sequences freed), then runs the decodes
and the prefill chunks and draws tokens with generate's sampler, each row with its request's own
settings (``draws.py``).

The forwards go through ``PagedCache`` (``kv_store.py``): the step's K/V are written into the pool,
and attention reads it through the rows' slots: where a step spans more than the backend's
``paged_columns``, in place with its kernel (``Ops.in_place_attention``: each row's attended slots
where they lie), else in pieces of that many columns (``Ops.paged_attention``: a bounded gather a
piece, a row sits out the pieces that hold only its padding, so rows of very different lengths
share a forward at no padding cost). A backend that
attends over each row's gathered K/V instead (``paged_columns`` None) splits a decode of very
different lengths into groups (``length_groups``), since one group gathers every row padded to its
longest. Fresh prompt chunks share one left-padded forward (the linear layers' ``prompt_mask`` keeps
padding out of their state, as generate does); chunks after a past share one forward per length.
"""

from __future__ import annotations

import functools
import gc
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..drivers import ForwardSignature, logits_of, past_of
from ..kv_cache import KVCacheManager, budget
from ..masks import min_finite, prefill_mask
from ..outputs import RoutedExperts
from ..parallel.model_group import gather_vocab_logits
from ..scoring import position_top_logprobs
from ..token_packing import GroupedPacking
from .config import EngineConfig
from .draws import Selection, select
from .kv_store import (
    NULL_SLOT,
    CacheLayout,
    KVStore,
    PagedCache,
    attention_pieces,
    in_place_columns,
    read_past,
    state_slots_nbytes,
    write_past,
)
from .outputs import ranked_entries
from .scheduler import Scheduled, Scheduler, SchedulerOutput


class _Prefill:
    """A sequence computing its tokens in chunks: its choices; ``has_state``: its state slot holds
    its recurrent states (after its first chunk, or a snapshot of its prefix)."""

    def __init__(self, key, request, choices: list, resume: bool):
        self.key, self.request, self.choices, self.resume = key, request, choices, resume
        self.has_state = False

    def tokens(self) -> List[int]:
        drawn = self.choices[0].token_ids if self.key[1] >= 0 else []
        return list(self.request.prompt) + list(drawn)


class _Rows:
    """One forward's rows (or one group of a grouped forward): (B, S) new tokens left-padded
    (``new_valid``) after (B, W) past columns (``past_valid``), the pool slots they ``read``
    ((B, W + S): the past, then their own) and write (the last S), their live states (gathered
    from their state ``slots``, where they have any)."""

    def __init__(self, ids, positions, past_valid, new_valid, read, routes: bool):
        self.ids, self.positions, self.read = ids, positions, read
        self.past_valid, self.new_valid = past_valid, new_valid
        self.routes = routes
        self.batch, self.width = ids.shape[0], past_valid.shape[1]
        self.write = read[:, self.width :]
        self.conv: Dict[int, Any] = {}
        self.recurrent: Dict[int, Any] = {}
        self.slots = np.zeros(0, dtype=np.int64)  # (B,) their state slots
        self.keep_all = np.zeros(self.batch, dtype=bool)  # rows whose every position's logits are kept
        self.order = None  # decode rows: their indices in the runner's rows
        self.items: List[Scheduled] = []  # prefill chunks: the chunks and their sequences
        self.entries: List[_Prefill] = []

    def mask(self, dtype: str) -> np.ndarray:
        """(B, 1, S, W + S) additive: each row's own past, then causal over its new columns."""
        b, s = self.ids.shape
        causal = prefill_mask(self.new_valid, s, dtype)
        past = np.where(self.past_valid, 0.0, min_finite(dtype)).astype(causal.dtype)
        return np.concatenate([np.broadcast_to(past[:, None, None, :], (b, 1, s, self.width)), causal], -1)


class StepResult:
    """What a step drew: ``samples`` (choices, ``Selection``, routing or None) per forward that drew,
    ``errors`` (request, error) of the requests whose forward or draw failed, and ``computed``: the
    sequences whose forward succeeded (the scheduler caches their blocks)."""

    def __init__(self):
        self.samples: List[tuple] = []
        self.errors: List[tuple] = []
        self.computed: set = set()


class ModelRunner:
    """The pool, the tables and live states, the forwards and the draws; see the module docstring.
    ``request_of(serial)``: the engine's ``Request`` of that serial (every rank keeps its own)."""

    def __init__(self, model, ops, dtype: str, layout: CacheLayout, store: KVStore, vocab_size, logprobs: bool):
        self.model, self.ops, self.dtype = model, ops, dtype
        self.signature = ForwardSignature(model)
        self.layout, self.store = layout, store
        self.vocab_size = vocab_size
        self.logprobs = logprobs  # rank 0 streams logprobs; the other ranks only need the tokens
        self.grammar = None  # grammar.GrammarBackend (set by the engine when it has a tokenizer)
        self.request_of: Callable = lambda serial: None
        self.tables: Dict[Any, List[int]] = {}
        self.prefills: Dict[Any, _Prefill] = {}
        self.rows: List[Any] = []  # decoding choices
        self.slot_of: Dict[Any, int] = {}  # every live sequence's state slot (KVStore's live-state pool)
        self.free_slots: List[int] = []
        self._reset_slots()
        self.routed: Optional[np.ndarray] = None  # (B, moe_layers, top_k) of the last decode, when asked
        # attention reads the pool in pieces of this many columns, skipping a row's padding
        # (``Ops.paged_attention``); a backend that attends over gathered K/V instead (None) splits
        # a decode of very different lengths by ``split_padding`` (``length_groups``)
        self.paged_columns: Optional[int] = getattr(ops, "paged_columns", None)
        # a step past one piece reads the pool in place instead, where the backend has the kernel
        # (``Ops.in_place_attention``; asking builds it once per host, before the first step)
        self.in_place: bool = bool(self.paged_columns) and ops.in_place_attention_kernel
        self.split_padding = SPLIT_PADDING
        self.boundary_states: Dict[Any, int] = {}  # key -> its state slot, at the last step's boundary

    def __len__(self) -> int:
        return len(self.rows) + len(self.prefills)

    def check_routes(self) -> RoutedExperts:
        """The recorder of the model's router choices (ValueError: the model reports no MoE routing)."""
        return RoutedExperts(self.ops, self.model)

    # ---- one step ------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run the step: one forward over every group of rows where the model takes a grouped step
        (decoding rows by length, fresh prompt chunks, chunks after a past by length), else one
        forward a group; then the draws."""
        result = StepResult()
        self._before(out)
        decodes = self._decode_groups(out.decodes) if out.decodes else []
        prefills = [self._prefill_group(chunks) for chunks in _batches(out.prefills)]
        outputs = self.forward(decodes + prefills)
        if decodes:
            self._decoded(decodes, outputs[: len(decodes)], result)
        if prefills:
            self._prefilled(prefills, outputs[len(decodes) :], result)
        return result

    def forward(self, groups: List["_Rows"]) -> list:
        """Every forward of a step (a seam: tests and the bench wrap it): per group, (logits, conv,
        recurrent, routing) or the exception its forward raised."""
        if len(groups) > 1 and self._groups_in_one_forward(groups):
            outputs = self._forward_all(groups)
            if outputs is not None:
                return outputs
        outputs = []
        for rows in groups:
            try:
                outputs.append(self._forward(rows))
            except Exception as error:
                outputs.append(error)
        return outputs

    def _groups_in_one_forward(self, groups) -> bool:
        grouped = self.layout.cache_object and getattr(self.model, "supports_grouped_step", False)
        return grouped and not any(g.routes for g in groups)  # (routing is recorded a forward at a time)

    def _before(self, out: SchedulerOutput) -> None:
        """What the last step left: snapshots, block copies, forks, frees; then this step's tables."""
        for key, slot in out.saves:
            self.store.save_snapshot(slot, self.boundary_states[key])
        self.boundary_states = {}
        for copy in out.copies:
            self.store.copy_block(*copy)
        for parent, children in out.forks:
            self._fork(parent, children)
        for key in out.freed:
            self.free(key)
        for item in out.decodes + out.prefills:
            if item.key in self.tables:
                self.tables[item.key].extend(item.blocks)
                continue
            self.tables[item.key] = list(item.blocks)
            if item.key not in self.prefills:
                request = self.request_of(item.key[0])
                choices = request.choices if item.key[1] < 0 else [request.choices[item.key[1]]]
                self.prefills[item.key] = _Prefill(item.key, request, list(choices), item.resume)
                self._own(item.key)
            if item.snapshot is not None:
                self.store.load_snapshot(item.snapshot, self.slot_of[item.key])
                self.prefills[item.key].has_state = True

    def _fork(self, parent, children) -> None:
        """A prompt's choices join the rows (their tables from the fork): the first takes the prompt's
        state slot, the others copies of it in slots of their own."""
        entry = self.prefills.pop(parent, None)
        self.tables.pop(parent, None)
        slot = self.slot_of.pop(parent, None)
        if entry is None:  # every choice was dropped meanwhile
            self._release(slot)
            return
        joined = []
        for key, table in children:
            choice = next((c for c in entry.choices if c.key == tuple(key)), None)
            if choice is not None:
                self.tables[choice.key] = list(table)
                joined.append(choice)
        if not joined:
            self._release(slot)
            return
        self.slot_of[joined[0].key] = slot
        copies = [self._own(choice.key) for choice in joined[1:]]
        if copies:
            self.store.copy_states(slot, copies)
        self.rows.extend(joined)

    # ---- state slots -----------------------------------------------------------------------------
    def _reset_slots(self) -> None:
        self.slot_of = {}
        self.free_slots = list(range(self.store.num_rows, 0, -1))  # (slot 0: the null slot)

    def _own(self, key) -> int:
        """A free state slot for sequence ``key`` (the scheduler runs at most ``num_rows`` at once)."""
        if not self.free_slots:
            raise RuntimeError(f"no free state slot for {key}: more than {self.store.num_rows} sequences run")
        self.slot_of[key] = slot = self.free_slots.pop()
        return slot

    def _release(self, slot: Optional[int]) -> None:
        if slot is not None:
            self.free_slots.append(slot)

    # ---- forwards ------------------------------------------------------------------------------
    def _forward(self, rows: "_Rows"):
        """One forward over (B, S) new tokens after (B, W) past columns: ((B, V) last logits, conv,
        recurrent, (B, layers, top_k) routing of the last positions or None)."""
        ops = self.ops
        host_mask = rows.mask(self.dtype)
        mask = ops.asarray(host_mask, self.dtype)
        kwargs = dict(position_ids=ops.asarray(rows.positions, "int64"), attention_mask=mask)
        tokens = ops.asarray(rows.ids, "int64")
        if self.layout.cache_object:
            cache = self._paged_cache(rows, host_mask)
            kwargs.update(past_key_values=cache, logits_to_keep=0 if rows.keep_all.any() else 1)
        else:
            width = rows.width
            kwargs.update(past_key_values=read_past(self.store, rows.read[:, :width]) if width else None)
        call = functools.partial(self._call, tokens, **kwargs)
        routed = None
        if rows.routes:
            recorder = self.check_routes()
            output, recorded = recorder.forward(call)
            routed = recorder.positions(recorded, rows.new_valid)[:, -1]
        else:
            output = call()
        if self.layout.cache_object:
            conv, recurrent = cache.conv_states, cache.recurrent_states
        else:
            conv, recurrent = {}, {}
            past_kv = past_of(output)
            if past_kv is None:
                raise TypeError(f"{type(self.model).__name__} returned no past_key_values")
            write_past(self.store, past_kv, rows.write, rows.width)
        logits = logits_of(output, ops)
        seq, counts = rows.ids.shape[1], rows.new_valid.sum(axis=1)
        every = {j: logits[j, seq - int(counts[j]) :] for j in map(int, np.flatnonzero(rows.keep_all))}
        return logits[:, -1], conv, recurrent, routed, every

    def _paged_cache(self, rows: "_Rows", mask: np.ndarray) -> PagedCache:
        cache = PagedCache(self.store, rows.write, rows.read, rows.width, rows.conv, rows.recurrent)
        columns = self.paged_columns
        if columns and rows.read.shape[1] > columns:
            if self.in_place:
                columns = in_place_columns(rows.read, rows.past_valid, rows.new_valid)
                cache.in_place = tuple(self.ops.asarray(array, "int64") for array in columns)
            else:
                cache.pieces = attention_pieces(self.ops, rows.read, mask, columns, self.dtype, self.store.block_size)
        if rows.width == 0 and not rows.new_valid.all():
            cache.prompt_mask = self.ops.asarray(rows.new_valid.astype(np.int64), self.dtype)
        return cache

    def _forward_all(self, groups: List["_Rows"]):
        """One forward over every group (``token_packing.GroupedPacking``): per group what
        ``_forward`` gives; None if it raised (each group then runs alone, so only what fails does)."""
        ops = self.ops
        keep, spans, at = [], [], 0  # the packed rows whose logits come back; per row, its span of them
        for rows in groups:
            for j, count in enumerate(rows.new_valid.sum(axis=1)):
                first = at if rows.keep_all[j] else at + int(count) - 1
                spans.append((len(keep), len(keep) + at + int(count) - first))
                keep.extend(range(first, at + int(count)))
                at += int(count)
        step = GroupedPacking(ops, [rows.new_valid for rows in groups], np.asarray(keep, dtype=np.int64))
        for group, rows in zip(step.groups, groups):
            host_mask = rows.mask(self.dtype)
            group.cache = self._paged_cache(rows, host_mask)
            group.mask = ops.asarray(host_mask, self.dtype)
            group.positions = ops.asarray(rows.positions, "int64")
        ids = np.concatenate([rows.ids[rows.new_valid] for rows in groups])[None]
        try:
            logits = logits_of(self._call(ops.asarray(ids, "int64"), past_key_values=step), ops)[:, -1]
        except Exception:
            return None
        outputs, row = [], 0
        for group, rows in zip(step.groups, groups):
            own = spans[row : row + rows.batch]
            row += rows.batch
            last = ops.take(logits, np.asarray([end - 1 for _, end in own]), 0)
            every = {j: logits[own[j][0] : own[j][1]] for j in map(int, np.flatnonzero(rows.keep_all))}
            outputs.append((last, group.cache.conv_states, group.cache.recurrent_states, None, every))
        return outputs

    def _call(self, ids, **kwargs):
        return self.model(ids, **self.signature.keep(kwargs))

    def _slots(self, key, start: int, end: int) -> np.ndarray:
        return self.store.slots(self.tables[key], start, end)

    def _scores(self, logits):
        return self.ops.cast(gather_vocab_logits(self.ops, self.model, logits), "float32")

    def _select(self, scores, choices) -> Selection:
        vocab = self.vocab_size or int(scores.shape[-1])
        return select(self.ops, scores, choices, vocab, self.logprobs, self.grammar)

    # ---- decode --------------------------------------------------------------------------------
    def _decode_groups(self, items: List[Scheduled]) -> List["_Rows"]:
        """The decoding rows the step names (all of them, in the usual case), in the rows' own order
        (so their states pass whole); on a backend without paged attention, split by length where
        one group would gather more padding than the rows' own positions (``length_groups``)."""
        index = {row.key: i for i, row in enumerate(self.rows)}
        by_row = {index[item.key]: item for item in items}
        order = np.asarray(sorted(by_row), dtype=np.int64)
        lengths = np.asarray([by_row[i].start for i in order], dtype=np.int64)
        routes = any(getattr(self.rows[i].request.params, "return_routed_experts", False) for i in order)
        groups = []
        split = [np.arange(len(order))] if self.paged_columns else length_groups(lengths, self.split_padding)
        for picked in split:
            rows = self._decode_rows(order[picked], lengths[picked], routes)
            rows.items = [by_row[i] for i in rows.order]
            groups.append(rows)
        return groups

    def _decode_rows(self, order: np.ndarray, lengths: np.ndarray, routes: bool) -> "_Rows":
        """The forward inputs of the rows at ``order`` (positions ``lengths``)."""
        b, width = len(order), int(lengths.max())
        read = np.full((b, width + 1), NULL_SLOT, dtype=np.int64)
        past_valid = np.zeros((b, width), dtype=bool)
        pending = np.zeros((b, 1), dtype=np.int64)
        for i, row in enumerate(order):
            n, choice = int(lengths[i]), self.rows[row]
            slots = self._slots(choice.key, 0, n + 1)
            read[i, :n], read[i, width] = slots[:n], slots[n]
            past_valid[i, :n] = True
            pending[i, 0] = choice.token_ids[-1]
        rows = _Rows(pending, lengths[:, None], past_valid, np.ones((b, 1), dtype=bool), read, routes)
        rows.order = order
        rows.slots = np.asarray([self.slot_of[self.rows[i].key] for i in order], dtype=np.int64)
        rows.conv, rows.recurrent = self.store.read_states(rows.slots)
        return rows

    def _decoded(self, groups: List["_Rows"], outputs, result: StepResult) -> None:
        """After the decode groups' forwards (``outputs``): their states kept, one token drawn a row."""
        order = np.concatenate([rows.order for rows in groups])
        rows = [self.rows[i] for i in order]
        ops, outs = self.ops, outputs
        try:
            failed = next((out for out in outs if isinstance(out, BaseException)), None)
            if failed is not None:
                raise failed
            logits = outs[0][0] if len(outs) == 1 else ops.concat([out[0] for out in outs], 0)
            scores = self._scores(logits)
        except Exception as error:  # the model failed: the rows in it fail, the engine goes on
            self._drop_rows({row.key for row in rows})
            result.errors += [(request, error) for request in {id(r.request): r.request for r in rows}.values()]
            return
        for group, out in zip(groups, outs):
            self.store.write_states(group.slots, out[1], out[2])
        routed = [out[3] for out in outs]
        self.routed = None if routed[0] is None else np.concatenate(routed)
        selection = self._select(scores, rows)  # (a bug here is the engine's: it stops, loudly)
        result.samples.append((rows, selection, self.routed))
        result.computed.update(row.key for row in rows)
        if self.layout.hybrid:
            for item in (i for g in groups for i in g.items):
                if item.boundary:
                    self.boundary_states[item.key] = self.slot_of[item.key]

    # ---- prefill -------------------------------------------------------------------------------
    def _prefill_group(self, chunks: List[Scheduled]) -> "_Rows":
        """The forward inputs of chunks: fresh ones (start 0) left-padded to the longest; chunks
        after a past all of one length (``_batches``), each row reading its own past."""
        entries = [self.prefills[item.key] for item in chunks]
        b = len(chunks)
        width = max(item.count for item in chunks)
        past = max(item.start for item in chunks)
        ids = np.zeros((b, width), dtype=np.int64)
        valid = np.zeros((b, width), dtype=bool)
        positions = np.zeros((b, width), dtype=np.int64)
        past_valid = np.zeros((b, past), dtype=bool)
        read = np.full((b, past + width), NULL_SLOT, dtype=np.int64)
        for j, (item, entry) in enumerate(zip(chunks, entries)):
            start, n = item.start, item.count
            end = start + n
            slots = self._slots(item.key, 0, end)
            ids[j, width - n :], valid[j, width - n :] = entry.tokens()[start:end], True
            positions[j, width - n :] = np.arange(start, end)
            past_valid[j, :start], read[j, :start], read[j, past + width - n :] = True, slots[:start], slots[start:]
        routes = any(item.sample and self._wants_routes(e) for item, e in zip(chunks, entries))
        rows = _Rows(ids, positions, past_valid, valid, read, routes)
        rows.items, rows.entries = chunks, entries
        rows.keep_all = np.asarray([item.all_logits for item in chunks], dtype=bool)
        rows.slots = np.asarray([self.slot_of[item.key] for item in chunks], dtype=np.int64)
        if entries[0].has_state:  # rows after a past: every one has its state
            rows.conv, rows.recurrent = self.store.read_states(rows.slots)
        return rows

    def _prefilled(self, groups: List["_Rows"], outputs, result: StepResult) -> None:
        """After the prefill groups' forwards (``outputs``; a group that raised is retried chunk by
        chunk, so only the request that fails does): the chunks' states kept, the first draws."""
        done = []
        for rows, output in zip(groups, outputs):
            try:
                if isinstance(output, BaseException):
                    raise output
                done += self._chunks_done(rows, output, result)
                continue
            except Exception as error:
                if rows.batch == 1:
                    self._fail_prefill(rows.items[0], error, result)
                    continue
            for item in rows.items:
                try:
                    alone = self._prefill_group([item])
                    done += self._chunks_done(alone, self._forward(alone), result)
                except Exception as error:
                    self._fail_prefill(item, error, result)
        for entry, logits, routed in done:
            self._draw_first(entry, logits, routed, result)

    def _fail_prefill(self, item: Scheduled, error, result: StepResult) -> None:
        entry = self.prefills.get(item.key)
        if entry is not None:
            result.errors.append((entry.request, error))
            self.free(item.key)

    def _wants_routes(self, entry: _Prefill) -> bool:
        return not entry.resume and bool(getattr(entry.request.params, "return_routed_experts", False))

    def _chunks_done(self, rows: "_Rows", output, result: StepResult) -> list:
        """Keep each chunk's states; (entry, (1, V) logits, routing) of the prompts it completed (a
        resumed choice that caught up joins the rows, to decode its pending token next)."""
        logits, conv, recurrent, routed, every = output
        b, done = rows.batch, []
        self.store.write_states(rows.slots, conv, recurrent)
        for j, (item, entry) in enumerate(zip(rows.items, rows.entries)):
            if item.all_logits:
                self._prompt_logprobs(entry.request, item, every[j])
            entry.has_state = True
            result.computed.add(item.key)
            if item.boundary and self.layout.hybrid:
                self.boundary_states[item.key] = self.slot_of[item.key]
            if item.sample:
                pick = logits if b == 1 else self.ops.take(logits, np.asarray([j]), 0)
                done.append((entry, pick, None if routed is None else routed[j]))
            elif entry.resume and item.start + item.count == len(entry.tokens()) - 1:
                self.rows.extend(self.prefills.pop(item.key).choices)  # (its state slot stays its own)
        return done

    def _prompt_logprobs(self, request, item: Scheduled, logits) -> None:
        """vLLM's ``prompt_logprobs`` of the chunk's prompt tokens from its own (count, V) logits:
        position p scores token p + 1 (the last prompt position's logits choose the first token)."""
        prompt = request.prompt
        scored = min(item.start + item.count, len(prompt) - 1) - item.start
        if item.start == 0:
            request.prompt_logprobs = [None]
        if scored <= 0:
            return
        logits = gather_vocab_logits(self.ops, self.model, logits[:scored])  # (every rank: a collective)
        if not self.logprobs:
            return
        tokens = np.asarray(prompt[item.start + 1 : item.start + 1 + scored], dtype=np.int64)
        found = position_top_logprobs(self.ops, logits, tokens, request.params.prompt_logprobs)
        request.prompt_logprobs += ranked_entries(tokens.tolist(), *found)

    def _draw_first(self, entry: _Prefill, logits, routed, result: StepResult) -> None:
        """A prompt done: its choices draw their first tokens (n choices from the same logits); one
        choice joins the rows now, n choices when the next step forks the prompt's blocks."""
        choices = entry.choices
        try:
            scores = self._scores(logits)
        except Exception as error:
            result.errors.append((entry.request, error))
            result.computed.discard(entry.key)
            self.free(entry.key)
            return
        if len(choices) > 1:
            scores = self.ops.take(scores, np.zeros(len(choices), dtype=np.int64), 0)
        selection = self._select(scores, choices)
        route = None if routed is None else np.repeat(routed[None], len(choices), axis=0)
        result.samples.append((choices, selection, route))
        if entry.key[1] >= 0:  # one choice: it decodes on in the prompt's state slot
            self.rows.extend(self.prefills.pop(entry.key).choices)

    # ---- leaving -------------------------------------------------------------------------------
    def drop(self, keys) -> None:
        """End these choices (a prompt's sequence goes when none of its choices is left)."""
        keys = set(keys)
        for key, entry in list(self.prefills.items()):
            entry.choices = [c for c in entry.choices if c.key not in keys]
            if not entry.choices:
                self.free(key)
        self._drop_rows(keys)

    def free(self, key) -> None:
        """Forget a sequence (dropped, preempted, failed): its table, its state slot."""
        self.tables.pop(key, None)
        self.prefills.pop(key, None)
        self._release(self.slot_of.pop(key, None))
        self._drop_rows({key})

    def _drop_rows(self, keys: set) -> None:
        if not any(row.key in keys for row in self.rows):
            return
        for row in self.rows:
            if row.key in keys:
                self.tables.pop(row.key, None)
                self._release(self.slot_of.pop(row.key, None))
        self.rows = [row for row in self.rows if row.key not in keys]

    def clear(self) -> None:
        self.boundary_states = {}
        self.tables.clear()
        self.prefills.clear()
        self.rows = []
        self._reset_slots()

    def sleep(self) -> None:
        """Release the pool's tensors (nothing runs)."""
        self.clear()
        self.store.release()
        gc.collect()
        self.ops.release_memory()

    def wake_up(self) -> None:
        self.store.allocate()


# a decode splits its rows in two forwards where that saves gathering at least this many padding
# positions, and more than the rows' own positions (docs/kv_cache.md)
SPLIT_PADDING = 2048


def length_groups(lengths: np.ndarray, padding: int = SPLIT_PADDING, most: int = 4) -> List[np.ndarray]:
    """The rows (indices) of a decode step in at most ``most`` forwards, by length: the group of the
    longest rows is split off while that saves more padding than ``SPLIT_PADDING`` and than the
    group's own positions (``padding``). One group (all rows, in order) in the usual case."""
    order = np.argsort(lengths, kind="stable")
    groups = [order]
    while len(groups) < most:
        best = None
        for g, rows in enumerate(groups):
            sizes = lengths[rows]
            if len(rows) < 2:
                continue
            cut = np.arange(1, len(rows))
            saving = cut * (sizes[-1] - sizes[cut - 1])
            k = int(np.argmax(saving))
            if saving[k] > max(padding, int(sizes.sum())) and (best is None or saving[k] > best[0]):
                best = (int(saving[k]), g, int(cut[k]))
        if best is None:
            break
        _, g, k = best
        groups[g : g + 1] = [groups[g][:k], groups[g][k:]]
    if len(groups) == 1:
        return [np.arange(len(lengths))]
    return groups


def _batches(items: List[Scheduled]) -> list:
    """The step's chunks in forwards: the fresh ones (no past, no state: left padding is masked out
    of the linear layers' state by ``prompt_mask``) together; the others together by chunk length
    (no padding: a padded position would decay a recurrent state it follows)."""
    fresh = [item for item in items if item.start == 0]
    groups: Dict[int, list] = {}
    for item in items:
        if item.start > 0:
            groups.setdefault(item.count, []).append(item)
    return ([fresh] if fresh else []) + list(groups.values())


def build(
    model,
    ops,
    dtype: str,
    config: EngineConfig,
    *,
    max_model_len: Optional[int],
    admit_batch: int,
    vocab_size,
    logprobs: bool,
):
    """(scheduler, runner, cache_memory_bytes): probe what the model's cache holds, size the pool from
    the budget (default: what ``max_batch_size`` rows of ``max_model_len`` positions could use,
    within a share of the host's available memory; ``kv_cache.budget``), and allocate it.
    ``max_model_len``: resolved (the model's context where ``config.max_model_len`` is None)."""
    block_size, enable_prefix_caching = config.block_size, config.enable_prefix_caching
    cache_memory_bytes, state_snapshot_blocks = config.kv_cache_memory_bytes, config.state_snapshot_blocks
    max_batch_size = config.max_num_seqs
    signature = ForwardSignature(model)
    layout = CacheLayout.probe(model, ops, lambda ids, **kwargs: model(ids, **signature.keep(kwargs)))
    per_block = max(layout.bytes_per_token() * block_size, 1)
    per_snapshot = layout.bytes_per_state() if layout.hybrid and enable_prefix_caching else 0
    live_states = state_slots_nbytes(layout, max_batch_size)  # (0 without recurrent layers)
    if cache_memory_bytes is None:
        positions = max_model_len if max_model_len else 1 << 20
        needed = max_batch_size * -(-positions // block_size) * per_block
        if per_snapshot:
            needed = int(needed / (1 - budget.SNAPSHOT_SHARE)) + 1
        cache_memory_bytes = budget.default_cache_bytes(needed + live_states, budget.available_host_bytes())
    if live_states and cache_memory_bytes < live_states + per_block:
        raise ValueError(
            f"cache_memory_bytes={cache_memory_bytes} cannot hold one KV cache block ({per_block} bytes) beside the "
            f"Gated DeltaNet states of max_num_seqs={max_batch_size} sequences ({live_states} bytes): give at least "
            f"{live_states + per_block}"
        )
    blocks_budget = cache_memory_bytes - live_states
    num_blocks, slots = budget.split_budget(blocks_budget, per_block, per_snapshot, state_snapshot_blocks)
    kv = KVCacheManager(
        num_blocks,
        block_size,
        enable_prefix_caching,
        state_snapshot_blocks,
        hybrid=layout.hybrid,
        num_snapshot_slots=slots,
    )
    store = KVStore(ops, layout, num_blocks, block_size, slots, max_batch_size)
    store.allocate()
    scheduler = Scheduler(kv, max_batch_size, config.max_num_batched_tokens, admit_batch)
    runner = ModelRunner(model, ops, dtype, layout, store, vocab_size, logprobs)
    return scheduler, runner, cache_memory_bytes


__all__ = ["ModelRunner", "StepResult", "build", "length_groups"]
