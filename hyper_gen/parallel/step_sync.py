"""Step-synced generation: ranks whose forwards are collective keep stepping together.

A model sharded by its trainer (FSDP / ZeRO-3 all-gather parameters inside every forward,
DTensor tensor parallelism runs collectives on activations) deadlocks when one rank stops
calling forward while another still waits in that forward's collective: the data-parallel
ranks of a rollout have different prompts, so their rows reach EOS at different steps. HF's
answer is ``synced_gpus``; this is the same contract with the cache kept on:

- before the first forward, one all-gather over the job tells every rank whether every rank's
  input was valid, and each rank's batch size (the global row offset of its seeded noise). A
  rank whose input was bad raises its error; every other rank raises a ``ValueError`` naming
  that rank and its message (broadcast from it), so no rank enters a forward the others will
  never join;
- after every step, one small all-reduce (is any row still running, which ranks failed) decides
  whether every rank is done. A rank whose rows are all finished keeps calling a one-token
  forward without cache (``dummy_step``) and discards it, so its collectives pair with the
  others' until the last rank finishes;
- an exception on one rank between two forwards (a logits processor, a NaN check, a callback)
  is reported at that step's all-reduce, and every other rank raises naming it; an exception
  inside a forward leaves the others waiting in that forward's collective, which the
  collective timeout (``parallel.launcher``) ends.

Which ranks: the whole job (the default group), since data parallelism spans it. Ranks of one
model-parallel group (``parallel_group``) share prompts and count once for the row offset.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .launcher import broadcast_text

# one row of the start-up all-gather: failed?, batch rows, global rank of this model group's leader
_START_FIELDS = 3


class RankFailed(ValueError):
    """Another rank of a step-synced generate raised; its rank and message are in the text."""


class StepSync:
    """The per-call collectives of a step-synced ``generate`` (see the module docstring)."""

    def __init__(self, ops, leader_rank: int, caller: str = "generate()", before: str = "before generating"):
        self.ops = ops
        self.caller, self.before = caller, before  # what the messages name: "generate()", "score()"
        self.rank = ops.rank()
        self.size = ops.world_size()
        self.leader_rank = leader_rank
        self.row_offset = 0
        self._failed_reported = False

    def start(self, error: Optional[BaseException], batch: int) -> None:
        """Exchange validity and batch size before the first forward; raise if any rank failed.

        Sets ``row_offset``: the rows of the model groups before this one, so seeded noise is keyed
        by the global row (a DP run draws what one process running the concatenated batch draws)."""
        mine = np.array([[0 if error is None else 1, batch, self.leader_rank]], dtype=np.float32)
        table = self.ops.to_numpy(self.ops.all_gather(self.ops.asarray(mine, "float32"), axis=0)).astype(np.int64)
        table = table.reshape(self.size, _START_FIELDS)
        failed = [int(r) for r in np.flatnonzero(table[:, 0])]
        if failed:
            self._raise_for(failed, error, self.before)
        leaders = np.arange(self.size) == table[:, 2]  # ranks that lead their model group
        before = leaders & (table[:, 2] < self.leader_rank)
        self.row_offset = int(table[before, 1].sum())

    def agree(self, error: Optional[BaseException]) -> None:
        """One more exchange before the first forward (after the model group compared its inputs):
        raise everywhere if any rank failed."""
        self._exchange(running=False, failed=error is not None, error=error, when=self.before)

    def step(self, running: bool) -> bool:
        """After a step: True when every rank's rows are finished. Raises when a rank reported failure."""
        return self._exchange(running=running, failed=False)

    def fail(self, error: BaseException) -> None:
        """This rank raised between forwards: tell the others at this step's exchange (then re-raise)."""
        if self._failed_reported:
            return
        self._failed_reported = True
        self._exchange(running=False, failed=True, error=error)

    def _exchange(self, running: bool, failed: bool, error=None, when: str = "during generation") -> bool:
        flags = np.zeros((1, 1 + self.size), dtype=np.float32)
        flags[0, 0] = float(running)
        flags[0, 1 + self.rank] = float(failed)
        try:
            total = self.ops.to_numpy(self.ops.all_reduce(self.ops.asarray(flags, "float32"), "sum")).reshape(-1)
        except BaseException:
            # the exchange itself failed (a peer stalled or gone: the collective timeout): reporting that
            # in another exchange would only wait out the timeout a second time
            self._failed_reported = True
            raise
        bad = [int(r) for r in np.flatnonzero(total[1:])]
        if bad:
            self._failed_reported = True
            self._raise_for(bad, error, when)
        return total[0] == 0

    def _raise_for(self, failed, error, when: str) -> None:
        """Every rank learns the first failing rank's message; the failing rank re-raises its own."""
        source = failed[0]
        mine = f"{type(error).__name__}: {error}" if self.rank == source else None
        text = broadcast_text(self.ops, mine, src=source)
        if error is not None:
            raise error
        raise RankFailed(
            f"{self.caller} failed on rank {source} {when} (rank(s) {failed} of {self.size} in this step-synced "
            f"{self.caller.rstrip('()')}), so every rank stops: {text}"
        )
