"""The running batch over a paged KV cache: rows, prefills in chunks, prefix hits, preemption.

Every row (a request's choice) owns a block table in ``kv_cache.KVCacheManager``; its K/V rows live
in the engine's pools (``kv_store.KVStore``) and a forward reads them through the table
(``PagedCache``: the step's K/V written into the pool, the rows' K/V gathered back for attention),
so a row pays for its own positions only, and requests with the same prompt prefix share its
blocks copy-free. Gated DeltaNet layers keep one live conv / recurrent state per row (dense, in row
order) and float snapshots at block boundaries, from which a prefix hit resumes.

A request first waits in ``prefilling`` (FIFO): each step ``prefill_step`` spends the step's token
budget (``max_num_batched_tokens`` less the decoding rows) on the queue's head: a request is given
blocks (its longest cached prefix shared, the rest allocated; ``allocate_for`` None: the pool is
full, it waits) and computes its next chunk. A hybrid model's chunks end at snapshot boundaries,
where the state is copied into its snapshot slot, so the next request with that prefix resumes
there. Fresh prompts computed whole in this step share one left-padded forward (the linear
layers' ``prompt_mask`` keeps padding out of their state, as generate does); every other chunk
(after a cached prefix, or a later chunk) runs alone, with its row's past read through its table.
When its last chunk is done the request's first tokens are chosen (by the engine) and its n
choices join the rows (``fork``: its full blocks shared, its partial last block copied).

Decode gives every row one slot for its pending token; when the pool has none left, the youngest
holder is preempted (vLLM's recompute preemption): a prefilling request starts over, a row's
choice goes back to the front of the queue as a "resume" (its prompt and tokens so far recomputed,
mostly from the prefix cache), and rejoins with the same pending token: nothing is lost or mixed.

Every rank of a multi-rank engine runs this code on the same plan, so the tables, the chunks and
the preemptions are the same on every rank (the bookkeeping is deterministic host code).
"""

from __future__ import annotations

import functools
import gc
from collections import deque
from typing import Any, Dict, List, Optional

import numpy as np

from ..drivers import ForwardSignature, logits_of, past_of
from ..kv_cache import KVCacheManager, budget
from ..masks import min_finite, prefill_mask
from ..outputs import RoutedExperts
from .config import EngineConfig
from .kv_store import NULL_SLOT, CacheLayout, KVStore, PagedCache, read_past, write_past


class Prefill:
    """A request (or one preempted choice, ``resume``) computing ``tokens`` into its blocks."""

    def __init__(self, key, tokens: List[int], choices: list, request=None, resume: bool = False):
        self.key = key  # its sequence in the manager
        self.tokens = tokens
        self.ids = np.asarray(tokens, dtype=np.int64)  # (compared with other prefills' each step it waits)
        self.choices = choices  # who joins the rows when it is done
        self.request = request
        self.resume = resume
        self.allocated = False
        self.computed = 0  # positions whose K/V are in the pool
        self.slotted = 0  # positions with a slot
        self.conv: Dict[int, Any] = {}  # (1, ...) live states of a recurrent model
        self.recurrent: Dict[int, Any] = {}

    def restart(self) -> None:
        self.allocated, self.computed, self.slotted = False, 0, 0
        self.conv, self.recurrent = {}, {}


class Finished:
    """A prefill done this step: its (1, V) logits, its routing when asked, or the error it raised."""

    def __init__(self, entry: Prefill, logits=None, routed=None, error: Optional[BaseException] = None):
        self.entry, self.logits, self.routed, self.error = entry, logits, routed, error


class PagedBatch:
    """The rows (choices), their lengths and pending tokens, the prefill queue and the cache."""

    def __init__(self, model, ops, dtype: str, layout: CacheLayout, kv: KVCacheManager, store: KVStore, budget: int):
        self.model, self.ops, self.dtype = model, ops, dtype
        self.signature = ForwardSignature(model)
        self.layout, self.kv, self.store = layout, kv, store
        self.max_num_batched_tokens = budget
        self.snapshot_every = (
            kv.snapshots.every_blocks * kv.block_size if (layout.hybrid and kv.enable_prefix_caching) else 0
        )
        self.rows: List[Any] = []
        self.lengths = np.zeros(0, dtype=np.int64)  # (B,) positions in the pool = the next token's position
        self.pending = np.zeros(0, dtype=np.int64)  # (B,) the token each row feeds next
        self.conv: Dict[int, Any] = {}  # (B, ...) live states, row order
        self.recurrent: Dict[int, Any] = {}
        self.prefilling: deque = deque()
        self.routed: Optional[np.ndarray] = None  # (B, moe_layers, top_k) of the last decode, when asked
        self.preemptions = 0
        self.split_padding = SPLIT_PADDING

    def __len__(self) -> int:
        """Rows running plus the choices of the requests still prefilling (the engine's slot count)."""
        return len(self.rows) + sum(len(e.choices) for e in self.prefilling)

    def holds(self, key) -> bool:
        return any(row.key == key for row in self.rows) or any(c.key == key for e in self.prefilling for c in e.choices)

    def check_routes(self) -> RoutedExperts:
        """The recorder of the model's router choices (ValueError: the model reports no MoE routing)."""
        return RoutedExperts(self.ops, self.model)

    # ---- queue ---------------------------------------------------------------------------------
    def enqueue(self, request) -> None:
        """A newly admitted request: its prompt is prefilled once for all its choices."""
        key = request.choices[0].key if len(request.choices) == 1 else ("prompt", request.serial)
        self.prefilling.append(Prefill(key, list(request.prompt), list(request.choices), request))

    # ---- forwards ------------------------------------------------------------------------------
    def _forward(self, ids, positions, past_valid, new_valid, write, read, conv, recurrent, routes: bool):
        """One forward over (B, S) new tokens after (B, W) past columns: ((B, V) last logits, conv,
        recurrent, (B, layers, top_k) routing of the last positions or None)."""
        ops, (b, s), width = self.ops, ids.shape, past_valid.shape[1]
        causal = prefill_mask(new_valid, s, self.dtype)  # (B, 1, S, S) over the step's own columns
        past = np.where(past_valid, 0.0, min_finite(self.dtype)).astype(causal.dtype)
        mask = np.concatenate([np.broadcast_to(past[:, None, None, :], (b, 1, s, width)), causal], -1)
        kwargs = dict(position_ids=ops.asarray(positions, "int64"), attention_mask=ops.asarray(mask, self.dtype))
        tokens = ops.asarray(ids, "int64")
        if self.layout.cache_object:
            cache = PagedCache(self.store, write, read, width, conv, recurrent)
            if width == 0 and not new_valid.all():
                cache.prompt_mask = ops.asarray(new_valid.astype(np.int64), self.dtype)
            kwargs.update(past_key_values=cache, logits_to_keep=1)
        else:
            kwargs.update(past_key_values=read_past(self.store, read[:, :width]) if width else None)
        call = functools.partial(self._call, tokens, **kwargs)
        routed = None
        if routes:
            recorder = self.check_routes()
            output, recorded = recorder.forward(call)
            routed = recorder.positions(recorded, new_valid)[:, -1]
        else:
            output = call()
        if self.layout.cache_object:
            conv, recurrent = cache.conv_states, cache.recurrent_states
        else:
            past_kv = past_of(output)
            if past_kv is None:
                raise TypeError(f"{type(self.model).__name__} returned no past_key_values")
            write_past(self.store, past_kv, write, width)
        return logits_of(output, ops)[:, -1], conv, recurrent, routed

    def _call(self, ids, **kwargs):
        return self.model(ids, **self.signature.keep(kwargs))

    def _slots(self, key, start: int, end: int) -> np.ndarray:
        return self.store.slots(self.kv.block_table(key), start, end)

    # ---- decode --------------------------------------------------------------------------------
    def decode(self):
        """One token for every row (after preempting what the pool cannot hold): (B, V) logits. Rows
        of very different lengths decode in separate forwards (``length_groups``): one forward reads
        every row's K/V padded to the longest row's, which for one long row among short ones costs
        more than a second forward."""
        self._reserve()
        if not self.rows:
            return None
        groups = length_groups(self.lengths, self.split_padding)
        routes = any(getattr(row.request.params, "return_routed_experts", False) for row in self.rows)
        if len(groups) == 1:
            logits, self.conv, self.recurrent, self.routed = self._decode_rows(np.arange(len(self.rows)), routes)
            self.lengths = self.lengths + 1
            return logits
        outs = [self._decode_rows(rows, routes) for rows in groups]
        back = np.argsort(np.concatenate(groups), kind="stable")  # the rows' places in the groups' order
        ops = self.ops
        logits = ops.take(ops.concat([out[0] for out in outs], 0), back, 0)
        for index, name in ((1, "conv"), (2, "recurrent")):
            setattr(
                self, name, {i: ops.take(ops.concat([o[index][i] for o in outs], 0), back, 0) for i in outs[0][index]}
            )
        routed = [out[3] for out in outs]
        self.routed = None if routed[0] is None else np.concatenate(routed)[back]
        self.lengths = self.lengths + 1
        return logits

    def _decode_rows(self, rows: np.ndarray, routes: bool):
        """One decode forward over the rows at indices ``rows`` (all of them, in order, or a group)."""
        whole = len(rows) == len(self.rows)
        lengths = self.lengths[rows]
        b, width = len(rows), int(lengths.max())
        read = np.full((b, width + 1), NULL_SLOT, dtype=np.int64)
        past_valid = np.zeros((b, width), dtype=bool)
        for i, row in enumerate(rows):
            n = int(lengths[i])
            slots = self._slots(self.rows[row].key, 0, n + 1)
            read[i, :n], read[i, width] = slots[:n], slots[n]
            past_valid[i, :n] = True
        pick = (lambda t: t) if whole else (lambda t: self.ops.take(t, rows, 0))
        return self._forward(
            self.pending[rows][:, None],
            lengths[:, None],
            past_valid,
            np.ones((b, 1), dtype=bool),
            read[:, width:],
            read,
            {i: pick(t) for i, t in self.conv.items()},
            {i: pick(t) for i, t in self.recurrent.items()},
            routes,
        )

    def cache_decoded(self) -> None:
        """After a decode's tokens are chosen: hash the blocks it filled (and snapshot a recurrent
        row's state at a boundary), so a later turn that repeats this text hits them."""
        if not self.kv.enable_prefix_caching:
            return
        for i, row in enumerate(self.rows):
            n = int(self.lengths[i])
            if n % self.kv.block_size:
                continue
            tokens = list(row.request.prompt) + row.token_ids[:-1]
            self._cache(row.key, tokens[:n], self.conv, self.recurrent, i)

    def _cache(self, key, tokens: List[int], conv, recurrent, row: int) -> None:
        wanted = [len(tokens)] if self.snapshot_every and len(tokens) % self.snapshot_every == 0 else []
        for _, slot in self.kv.cache_full_blocks(key, tokens, snapshot_positions=wanted).items():
            self.store.save_snapshot(slot, conv, recurrent, row)

    def _reserve(self) -> None:
        """A slot for every row's pending token; the youngest holders are preempted while none is free."""
        i = 0
        while i < len(self.rows):
            if self.kv.append(self.rows[i].key, 1):
                i += 1
                continue
            holders = [e for e in self.prefilling if e.allocated]
            if holders:
                self._preempt_prefill(holders[-1])
            else:
                self._preempt_row(len(self.rows) - 1)

    def _preempt_prefill(self, entry: Prefill) -> None:
        self.kv.free(entry.key)
        entry.restart()
        self.preemptions += 1

    def _preempt_row(self, i: int) -> None:
        row = self.rows[i]
        self.kv.free(row.key)
        tokens = list(row.request.prompt) + row.token_ids[:-1]
        self._remove([j for j in range(len(self.rows)) if j != i])
        self.prefilling.appendleft(Prefill(row.key, tokens, [row], row.request, resume=True))
        self.preemptions += 1

    # ---- prefill -------------------------------------------------------------------------------
    def _chunk_end(self, entry: Prefill, budget: int) -> int:
        end = min(len(entry.tokens), entry.computed + budget)
        if self.snapshot_every:  # stop at the next boundary, to snapshot the state there
            boundary = (entry.computed // self.snapshot_every + 1) * self.snapshot_every
            end = min(end, boundary)
        return end

    def _shares_a_prefix_in_flight(self, entry: Prefill) -> bool:
        """Whether a prefill under way is still computing a prefix this one could hit (32 requests
        with one system prompt, admitted together: the first computes it, the others wait for it
        rather than each computing it)."""
        if not self.kv.enable_prefix_caching:
            return False
        unit = self.snapshot_every or self.kv.block_size  # where a hit may end
        tokens = entry.ids
        for other in self.prefilling:
            if other is entry or not other.allocated or other.computed >= len(other.tokens):
                continue
            n = min(len(tokens) - 1, len(other.tokens))  # (a hit leaves its last token to compute)
            same = np.flatnonzero(tokens[:n] != other.ids[:n])
            shared = (int(same[0]) if same.size else n) // unit * unit
            if shared > other.computed // unit * unit:
                return True
        return False

    def _schedule(self) -> list:
        """(entry, start, end) of the chunks this step computes, within the token budget."""
        budget = max(self.max_num_batched_tokens - len(self.rows), 1)
        chunks = []
        for entry in self.prefilling:
            if budget <= 0:
                break
            if not entry.allocated:
                if self._shares_a_prefix_in_flight(entry):
                    continue  # it will hit that prefix once computed, instead of computing it again
                allocation = self.kv.allocate_for(entry.key, entry.tokens, new_tokens=budget)
                while allocation is None:  # the pool is full: a younger prefill gives its blocks back
                    younger = [e for e in self.prefilling if e.allocated and e is not entry]
                    if not younger or younger[-1] in [c[0] for c in chunks]:
                        break
                    self._preempt_prefill(younger[-1])
                    allocation = self.kv.allocate_for(entry.key, entry.tokens, new_tokens=budget)
                if allocation is None:
                    break  # wait (FIFO): rows finishing will free blocks
                entry.allocated = True
                entry.computed = allocation.num_computed_tokens
                entry.slotted = entry.computed + allocation.num_new_tokens
                if allocation.snapshot_slot is not None:
                    entry.conv, entry.recurrent = self.store.load_snapshot(allocation.snapshot_slot)
            end = self._chunk_end(entry, budget)
            if end > entry.slotted:
                if not self.kv.append(entry.key, end - entry.slotted):
                    break
                entry.slotted = end
            chunks.append((entry, entry.computed, end))
            budget -= end - entry.computed
        return chunks

    def prefill_step(self) -> List[Finished]:
        """Compute this step's chunks, batched (``_batches``); the prefills that completed or failed."""
        finished: List[Finished] = []
        for chunks in _batches(self._schedule()):
            try:
                finished += self._prefill(chunks)
                continue
            except Exception as error:
                if len(chunks) == 1:
                    self._discard(chunks[0][0])
                    finished.append(Finished(chunks[0][0], error=error))
                    continue
            for chunk in chunks:  # find the one that fails; the others are fine alone
                try:
                    finished += self._prefill([chunk])
                except Exception as error:
                    self._discard(chunk[0])
                    finished.append(Finished(chunk[0], error=error))
        return finished

    def _wants_routes(self, entry: Prefill) -> bool:
        return not entry.resume and bool(getattr(entry.request.params, "return_routed_experts", False))

    def _prefill(self, chunks) -> List[Finished]:
        """One forward over chunks (entry, start, end): fresh ones (start 0) left-padded to the
        longest; chunks after a past all of one length (``_batches``), each row reading its own past."""
        b = len(chunks)
        width = max(end - start for _, start, end in chunks)
        past = max(start for _, start, _ in chunks)
        ids = np.zeros((b, width), dtype=np.int64)
        valid = np.zeros((b, width), dtype=bool)
        positions = np.zeros((b, width), dtype=np.int64)
        past_valid = np.zeros((b, past), dtype=bool)
        read = np.full((b, past + width), NULL_SLOT, dtype=np.int64)
        for j, (entry, start, end) in enumerate(chunks):
            n, slots = end - start, self._slots(entry.key, 0, end)
            ids[j, width - n :], valid[j, width - n :] = entry.tokens[start:end], True
            positions[j, width - n :] = np.arange(start, end)
            past_valid[j, :start], read[j, :start], read[j, past + width - n :] = True, slots[:start], slots[start:]
        states = {}
        if chunks[0][0].conv or chunks[0][0].recurrent:  # rows after a past: every one has its state
            for name in ("conv", "recurrent"):
                layers = getattr(chunks[0][0], name)
                states[name] = {i: self.ops.concat([getattr(e, name)[i] for e, _, _ in chunks], 0) for i in layers}
        final = [end == len(entry.tokens) for entry, _, end in chunks]
        routes = any(f and self._wants_routes(entry) for f, (entry, _, _) in zip(final, chunks))
        logits, conv, recurrent, routed = self._forward(
            ids,
            positions,
            past_valid,
            valid,
            read[:, past:],
            read,
            states.get("conv", {}),
            states.get("recurrent", {}),
            routes,
        )
        finished = []
        for j, (entry, _, end) in enumerate(chunks):
            row = np.asarray([j])
            entry.conv = {layer: t if b == 1 else self.ops.take(t, row, 0) for layer, t in conv.items()}
            entry.recurrent = {layer: t if b == 1 else self.ops.take(t, row, 0) for layer, t in recurrent.items()}
            entry.computed = end
            self._cache(entry.key, entry.tokens[:end], entry.conv, entry.recurrent, 0)
            if final[j]:
                row_logits = logits if b == 1 else self.ops.take(logits, row, 0)
                finished.append(Finished(entry, row_logits, None if routed is None else routed[j : j + 1]))
        return finished

    def _discard(self, entry: Prefill) -> None:
        """Take a prefill out of the queue, its blocks back to the pool."""
        if entry in self.prefilling:
            self.prefilling.remove(entry)
        if entry.allocated:
            self.kv.free(entry.key)
        entry.restart()

    # ---- rows ----------------------------------------------------------------------------------
    def join(self, entry: Prefill, first_tokens: np.ndarray) -> None:
        """A finished prefill's choices become rows (a resume rejoins with its pending token)."""
        self.prefilling.remove(entry)
        choices = entry.choices
        if entry.resume:
            pending = np.asarray([entry.choices[0].token_ids[-1]], dtype=np.int64)
        else:
            pending = np.asarray(first_tokens, dtype=np.int64)
        if not entry.resume and len(choices) > 1:
            joined = []
            for choice in choices:
                fork = self.kv.fork(entry.key, choice.key)
                if fork is None:  # no block left for its partial last block: recompute it later
                    self.prefilling.appendleft(
                        Prefill(choice.key, list(entry.tokens), [choice], entry.request, resume=True)
                    )
                    continue
                if fork.copy is not None:
                    self.store.copy_block(*fork.copy)
                joined.append(choice)
            self.kv.free(entry.key)
            pending = pending[[choices.index(c) for c in joined]]
            choices = joined
        if not choices:
            return
        repeat = np.zeros(len(choices), dtype=np.int64)
        for store, states in ((self.conv, entry.conv), (self.recurrent, entry.recurrent)):
            for layer, state in states.items():
                rows = self.ops.take(state, repeat, 0)
                store[layer] = rows if not self.rows else self.ops.concat([store[layer], rows], 0)
        self.rows.extend(choices)
        self.lengths = np.concatenate([self.lengths, np.full(len(choices), len(entry.tokens), dtype=np.int64)])
        self.pending = np.concatenate([self.pending, pending])

    def _remove(self, keep: List[int]) -> None:
        keep_array = np.asarray(keep, dtype=np.int64)
        self.rows = [self.rows[i] for i in keep]
        self.lengths, self.pending = self.lengths[keep_array], self.pending[keep_array]
        for store in (self.conv, self.recurrent):
            for layer in list(store):
                if keep:
                    store[layer] = self.ops.take(store[layer], keep_array, 0)
                else:
                    del store[layer]

    def drop(self, keys) -> None:
        """End the rows and prefills of these choice keys; their blocks go back to the pool."""
        keys = set(keys)
        for entry in [e for e in self.prefilling if any(c.key in keys for c in e.choices)]:
            entry.choices = [c for c in entry.choices if c.key not in keys]
            if not entry.choices:
                self._discard(entry)
        gone = {i for i, row in enumerate(self.rows) if row.key in keys}
        if gone:
            for i in gone:
                self.kv.free(self.rows[i].key)
            self._remove([i for i in range(len(self.rows)) if i not in gone])

    def clear(self) -> None:
        for entry in list(self.prefilling):
            self._discard(entry)
        for row in self.rows:
            self.kv.free(row.key)
        self._remove([])

    def reset_prefix_cache(self, extra_key) -> None:
        """Nothing cached so far is served again (a weight update); blocks hash with ``extra_key``."""
        self.kv.reset(extra_key)

    def sleep(self) -> None:
        """Release the pool's tensors (the batch is empty) and drop the prefix cache."""
        self.kv.reset(self.kv.prefix.extra_key)
        self.store.release()
        gc.collect()
        self.ops.release_memory()

    def wake_up(self) -> None:
        self.store.allocate()

    def stats(self) -> Dict[str, int]:
        stats = self.kv.stats()
        stats["preemptions"] = self.preemptions
        return stats


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


def _batches(chunks) -> list:
    """The step's chunks in forwards: the fresh ones (no past, no state: left padding is masked out
    of the linear layers' state by ``prompt_mask``) together; the others together by chunk length
    (no padding: a padded position would decay a recurrent state it follows)."""
    fresh = [c for c in chunks if c[1] == 0]
    groups: Dict[int, list] = {}
    for chunk in chunks:
        if chunk[1] > 0:
            groups.setdefault(chunk[2] - chunk[1], []).append(chunk)
    return ([fresh] if fresh else []) + list(groups.values())


def build_paged_batch(model, ops, dtype: str, config: EngineConfig, max_model_len: Optional[int]) -> PagedBatch:
    """Probe what the model's cache holds, size the pool from the budget (default: what
    ``max_batch_size`` rows of ``max_model_len`` positions could use, within a share of the host's
    available memory; ``kv_cache.budget``), and allocate it. ``config``: the engine's settings;
    ``max_model_len``: resolved (the model's context where ``config.max_model_len`` is None)."""
    block_size, enable_prefix_caching = config.block_size, config.enable_prefix_caching
    max_num_batched_tokens, cache_memory_bytes = config.max_num_batched_tokens, config.kv_cache_memory_bytes
    state_snapshot_blocks, max_batch_size = config.state_snapshot_blocks, config.max_num_seqs
    signature = ForwardSignature(model)
    layout = CacheLayout.probe(model, ops, lambda ids, **kwargs: model(ids, **signature.keep(kwargs)))
    per_block = max(layout.bytes_per_token() * block_size, 1)
    per_snapshot = layout.bytes_per_state() if layout.hybrid and enable_prefix_caching else 0
    if cache_memory_bytes is None:
        positions = max_model_len if max_model_len else 1 << 20
        needed = max_batch_size * -(-positions // block_size) * per_block
        if per_snapshot:
            needed = int(needed / (1 - budget.SNAPSHOT_SHARE)) + 1
        cache_memory_bytes = budget.default_cache_bytes(needed, budget.available_host_bytes())
    num_blocks, slots = budget.split_budget(cache_memory_bytes, per_block, per_snapshot, state_snapshot_blocks)
    kv = KVCacheManager(
        num_blocks,
        block_size,
        enable_prefix_caching,
        state_snapshot_blocks,
        hybrid=layout.hybrid,
        num_snapshot_slots=slots,
    )
    store = KVStore(ops, layout, num_blocks, block_size, slots)
    store.allocate()
    batch = PagedBatch(model, ops, dtype, layout, kv, store, max_num_batched_tokens)
    batch.cache_memory_bytes = cache_memory_bytes
    return batch


__all__ = ["PagedBatch", "Prefill", "Finished", "build_paged_batch"]
