"""The scheduler: which sequences compute which tokens in the next step, within one token budget.

Rank 0 runs it; its ``SchedulerOutput`` is all the model runner of every rank needs to execute the
step (``runner.py``), so the other ranks of a tensor-parallel engine keep no bookkeeping of their
own: the plan rank 0 shares carries the output (``plan.py``).

A ``Sequence`` is what computes into the paged cache: a request's prompt (one for all its n
choices), or one choice (its prompt and the tokens it has drawn). Its state is one number,
``num_computed_tokens``, against its tokens: while fewer than ``prefill_end`` are computed it
prefills in chunks; after that each step computes its last token (a decode) and the runner draws
the next. Sequences wait in ``waiting`` (FIFO: new requests, and preempted ones at the front) and
hold blocks while in ``running`` (admission order, oldest first).

One loop per step, as vLLM's v1 scheduler has it: the running sequences first, oldest first (a
decode needs one slot; a prefill chunk takes what the budget leaves, ending at a state snapshot
boundary on a hybrid model), then the waiting ones while slots, budget and blocks last. When the
pool cannot hold what a running sequence needs, the youngest running sequence is preempted
(recomputed later, mostly from the prefix cache), down to the one asking: the oldest always makes
progress, so no mix of requests can wedge the engine (two prompts that each fit the pool alone,
prefilled side by side, used to stop each other half way for good). Nothing is admitted in a step
that preempted. A waiting prompt that shares a prefix another running prefill is still computing
waits for it, to hit it once cached rather than compute it twice.

After the step (``update``), the blocks it filled are hashed for prefix caching, a hybrid
sequence's state at a snapshot boundary is saved, and a prompt done for n choices forks into them
(full blocks shared, the partial last block copied); what the runner must do for those travels in
the next step's output (``saves``, ``copies``, ``forks``), before that step's forward (the runner
keeps a sequence's state at each boundary it reaches until then, so a save survives the sequence).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..kv_cache import KVCacheManager

Key = Tuple[int, int]  # (request serial, choice index); index -1: a request's prompt for n > 1 choices


class Sequence:
    """One sequence's place in the schedule: its tokens (the prompt, and the choice's drawn tokens),
    how many are computed, and how many have a slot in its blocks."""

    def __init__(self, key: Key, request, choices: list, resume: bool = False):
        self.key = key
        self.request = request
        self.choices = choices  # who draws from its logits: all n for a prompt, else its one choice
        self.resume = resume  # a preempted choice: recompute up to its pending token, then decode
        # prompt logprobs come from the prompt's own forward: every position computed, none hit
        self.all_logits = not resume and request.params.prompt_logprobs is not None
        self.prompt = np.asarray(request.prompt, dtype=np.int64)  # (compared with other prompts while it waits)
        self.prefill_end = self.num_tokens - 1 if resume else self.num_tokens
        self.num_computed_tokens = 0
        self.num_slotted = 0  # positions with a slot (a hit may give more than the first chunk computes)
        self.allocated = False
        self.scheduled = 0  # tokens scheduled in the current step
        self.new_blocks: List[int] = []  # blocks its table gained in the current step

    @property
    def single(self) -> bool:
        return self.key[1] >= 0

    @property
    def num_tokens(self) -> int:
        drawn = len(self.choices[0].token_ids) if self.single else 0
        return len(self.request.prompt) + drawn

    def tokens(self) -> List[int]:
        return list(self.request.prompt) + (list(self.choices[0].token_ids) if self.single else [])

    @property
    def decoding(self) -> bool:
        return self.num_computed_tokens >= self.prefill_end

    def restart(self) -> None:
        self.num_computed_tokens = self.num_slotted = 0
        self.allocated = False


@dataclass
class Scheduled:
    """One sequence's work in a step: positions [start, start + count) of its tokens."""

    key: Key
    start: int
    count: int
    blocks: List[int]  # blocks appended to its table this step (its whole table when first scheduled)
    snapshot: Optional[int] = None  # a hybrid prefix hit: resume from this snapshot slot's state
    resume: bool = False
    sample: bool = False  # the step computes its last known token: the runner draws the next
    boundary: bool = False  # it ends at a state snapshot boundary: the runner keeps the state there
    all_logits: bool = False  # a prompt chunk whose every position's logits give prompt logprobs


@dataclass
class SchedulerOutput:
    """A step for the runners: what to do before the forward (``saves`` of live states into snapshot
    slots, block ``copies``, prompt ``forks`` into their choices' sequences, ``freed`` sequences),
    then the decodes and the prefill chunks. ``new_requests``: serials of requests whose sequences
    appear for the first time (their prompt and settings travel in the step plan)."""

    saves: List[Tuple[Key, int]] = field(default_factory=list)
    copies: List[Tuple[int, int, int]] = field(default_factory=list)
    forks: List[Tuple[Key, List[Tuple[Key, List[int]]]]] = field(default_factory=list)
    freed: List[Key] = field(default_factory=list)
    decodes: List[Scheduled] = field(default_factory=list)
    prefills: List[Scheduled] = field(default_factory=list)
    new_requests: List[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.saves or self.copies or self.forks or self.freed or self.decodes or self.prefills)

    def encode(self) -> dict:
        def items(scheduled):
            return [
                [list(s.key), s.start, s.count, s.blocks, s.snapshot, s.resume, s.sample, s.boundary, s.all_logits]
                for s in scheduled
            ]

        return {
            "saves": [[list(k), slot] for k, slot in self.saves],
            "copies": [list(c) for c in self.copies],
            "forks": [[list(p), [[list(k), t] for k, t in children]] for p, children in self.forks],
            "freed": [list(k) for k in self.freed],
            "decodes": items(self.decodes),
            "prefills": items(self.prefills),
            "new": self.new_requests,
        }

    @classmethod
    def decode(cls, data: dict) -> "SchedulerOutput":
        def items(rows):
            return [Scheduled(tuple(row[0]), *row[1:]) for row in rows]

        return cls(
            saves=[(tuple(k), slot) for k, slot in data["saves"]],
            copies=[tuple(c) for c in data["copies"]],
            forks=[(tuple(p), [(tuple(k), t) for k, t in children]) for p, children in data["forks"]],
            freed=[tuple(k) for k in data["freed"]],
            decodes=items(data["decodes"]),
            prefills=items(data["prefills"]),
            new_requests=list(data["new"]),
        )


class Scheduler:
    """Waiting and running sequences over one ``KVCacheManager``; see the module docstring.

    ``max_num_seqs``: choices running at once (a prompt counts its n). ``admit_batch``: admit only
    once that many slots are free, or nothing runs (an offline job's prefills then share forwards).
    ``snapshot_every``: positions between a hybrid model's state snapshots (0: none)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, admit_batch: int = 1):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admit_batch = admit_batch
        snapshots = kv.hybrid and kv.enable_prefix_caching
        self.snapshot_every = kv.snapshots.every_blocks * kv.block_size if snapshots else 0
        self.waiting: deque = deque()
        self.running: List[Sequence] = []
        self.preemptions = 0
        self._seen: set = set()  # serials of requests already sent to the runners
        self._next = SchedulerOutput()  # what the last update left for the next step's runners

    # ---- requests in and out -------------------------------------------------------------------
    def add(self, request) -> None:
        """A request's prompt joins the queue, one sequence for all its choices."""
        choices = list(request.choices)
        key = choices[0].key if len(choices) == 1 else (request.serial, -1)
        self.waiting.append(Sequence(key, request, choices))

    def drop(self, keys) -> None:
        """End these choices: their sequences leave (a prompt's when none of its choices is left)."""
        keys = set(keys)
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if not any(c.key in keys for c in seq.choices):
                    continue
                seq.choices = [c for c in seq.choices if c.key not in keys]
                if not seq.choices:
                    self._remove(seq)

    def clear(self) -> None:
        for seq in list(self.waiting) + list(self.running):
            self._remove(seq)
        self._next = SchedulerOutput()  # (the runners forget everything too)

    def _remove(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.allocated:
            self.kv.free(seq.key)
            self._next.freed.append(seq.key)
        seq.restart()
        if not any(other.request is seq.request for other in (*self.waiting, *self.running)):
            self._seen.discard(seq.request.serial)  # its last sequence left: bounded by what is in flight

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def num_running_choices(self) -> int:
        return sum(len(seq.choices) for seq in self.running)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out, self._next = self._next, SchedulerOutput()
        for seq in self.running:
            seq.scheduled = 0
        decoding = sum(1 for seq in self.running if seq.decoding)
        budget = max(self.max_num_batched_tokens - decoding, 1)  # what the prefill chunks may take
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.decoding:
                count = seq.num_tokens - seq.num_computed_tokens
                if count != 1:  # (drawn nothing yet: a failed or finished choice, dropped next step)
                    i += 1
                    continue
            else:
                if budget <= 0:
                    i += 1
                    continue
                count = self._chunk_end(seq, budget) - seq.num_computed_tokens
            if self._slots(seq, count, out):
                self._schedule(seq, count, out)
                if not seq.decoding:
                    budget -= count
                i += 1
                continue
            preempted = True  # _slots preempted down to seq itself
        if not preempted:
            self._admit(budget, out)
        for seq in self.running:
            seq.num_computed_tokens += seq.scheduled
        return out

    def _slots(self, seq: Sequence, count: int, out: SchedulerOutput) -> bool:
        """Slots for ``count`` more positions of a running sequence; preempts the youngest running
        sequences while the pool has none; False when ``seq`` itself was preempted."""
        end = seq.num_computed_tokens + count
        while end > seq.num_slotted:
            before = len(self.kv.block_table(seq.key))
            if self.kv.append(seq.key, end - seq.num_slotted):
                seq.num_slotted = end
                seq.new_blocks = self.kv.block_table(seq.key)[before:]
                return True
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        seq.new_blocks = []
        return True

    def _schedule(self, seq: Sequence, count: int, out: SchedulerOutput, first=None) -> None:
        start = seq.num_computed_tokens
        blocks, snapshot = first if first is not None else (seq.new_blocks, None)
        seq.scheduled = count
        end = start + count
        boundary = bool(self.snapshot_every) and end % self.snapshot_every == 0
        item = Scheduled(
            seq.key, start, count, list(blocks), snapshot, seq.resume, end == seq.num_tokens, boundary, seq.all_logits
        )
        (out.decodes if seq.decoding else out.prefills).append(item)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: the blocks go back (cached ones stay for the hit), the sequence waits
        at the front of the queue; a preempted choice recomputes its prompt and tokens, then decodes."""
        self.running.remove(seq)
        self.kv.free(seq.key)
        out.freed.append(seq.key)
        out.decodes[:] = [s for s in out.decodes if s.key != seq.key]
        out.prefills[:] = [s for s in out.prefills if s.key != seq.key]
        self.preemptions += 1
        if seq.single and (seq.resume or seq.decoding):
            seq = Sequence(seq.key, seq.request, seq.choices, resume=True)
        else:
            seq.restart()
        self.waiting.appendleft(seq)

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        free = self.max_num_seqs - self.num_running_choices()
        wanted = sum(len(seq.choices) for seq in list(self.waiting)[: self.admit_batch])
        if free < min(self.admit_batch, wanted) and free < self.max_num_seqs:
            return  # wait for more slots, then prefill several requests in one forward
        for seq in list(self.waiting):
            if budget <= 0 or len(seq.choices) > free:
                break
            if not seq.all_logits and self._waits_for_prefix(seq):
                continue
            tokens = seq.tokens()[: seq.prefill_end]
            allocation = self.kv.allocate_for(seq.key, tokens, new_tokens=budget, lookup=not seq.all_logits)
            if allocation is None:
                break  # FIFO: the blocks come back as running sequences finish
            self.waiting.remove(seq)
            self.running.append(seq)
            free -= len(seq.choices)
            seq.allocated = True
            seq.num_computed_tokens = allocation.num_computed_tokens
            seq.num_slotted = seq.num_computed_tokens + allocation.num_new_tokens
            count = self._chunk_end(seq, budget) - seq.num_computed_tokens
            if seq.request.serial not in self._seen:
                self._seen.add(seq.request.serial)
                seq.request.cached_tokens = allocation.num_computed_tokens
                out.new_requests.append(seq.request.serial)
            self._schedule(seq, count, out, first=(allocation.block_table, allocation.snapshot_slot))
            budget -= count

    def _chunk_end(self, seq: Sequence, budget: int) -> int:
        end = min(seq.prefill_end, seq.num_computed_tokens + budget)
        if self.snapshot_every:  # stop at the next boundary, to snapshot the state there
            boundary = (seq.num_computed_tokens // self.snapshot_every + 1) * self.snapshot_every
            end = min(end, boundary)
        return end

    def _waits_for_prefix(self, seq: Sequence) -> bool:
        """Whether a running prefill is still computing a prefix ``seq`` could hit."""
        if not self.kv.enable_prefix_caching:
            return False
        unit = self.snapshot_every or self.kv.block_size  # where a hit may end
        tokens = seq.prompt
        for other in self.running:
            done = other.num_computed_tokens  # (before this step: its chunk is not cached yet)
            if done >= other.prefill_end:
                continue
            n = min(len(tokens) - 1, len(other.prompt))  # (a hit leaves its last token to compute)
            same = np.flatnonzero(tokens[:n] != other.prompt[:n])
            shared = (int(same[0]) if same.size else n) // unit * unit
            if shared > done // unit * unit:
                return True
        return False

    # ---- after the step ------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, computed: set) -> None:
        """After the runners ran ``out`` (``computed``: the keys whose forward succeeded): cache
        the blocks they filled and fork the prompts done for n choices."""
        running = {seq.key: seq for seq in self.running}  # (one lookup a row, not a scan)
        for prefill, items in ((False, out.decodes), (True, out.prefills)):
            for item in items:
                seq = running.get(item.key)
                if seq is None or item.key not in computed:
                    continue
                end = item.start + item.count
                if self.kv.enable_prefix_caching and (prefill or end % self.kv.block_size == 0):
                    self._cache(seq, end)
                if item.sample and not seq.single:
                    self._fork(seq)

    def _cache(self, seq: Sequence, end: int) -> None:
        wanted = [end] if self.snapshot_every and end % self.snapshot_every == 0 else []
        tokens = seq.tokens()[:end]
        for _, slot in self.kv.cache_full_blocks(seq.key, tokens, snapshot_positions=wanted).items():
            self._next.saves.append((seq.key, slot))

    def _fork(self, seq: Sequence) -> None:
        """A prompt done for n choices: each choice gets a sequence sharing its blocks (a partial last
        block copied); one that finds no free block recomputes its prompt later (a resume)."""
        index = self.running.index(seq)
        children, joined = [], []
        for choice in seq.choices:
            child = Sequence(choice.key, seq.request, [choice])
            fork = self.kv.fork(seq.key, choice.key)
            if fork is None:
                self.waiting.appendleft(Sequence(choice.key, seq.request, [choice], resume=True))
                continue
            if fork.copy is not None:
                self._next.copies.append(fork.copy)
            child.allocated = True
            child.num_computed_tokens = child.num_slotted = seq.num_computed_tokens
            child.prefill_end = seq.num_computed_tokens
            children.append((choice.key, fork.block_table))
            joined.append(child)
        self._next.forks.append((seq.key, children))
        self.running[index : index + 1] = joined
        self.kv.free(seq.key)

    def stats(self) -> Dict[str, int]:
        stats = self.kv.stats()
        stats["preemptions"] = self.preemptions
        return stats


__all__ = ["Key", "Scheduled", "Scheduler", "SchedulerOutput", "Sequence"]
