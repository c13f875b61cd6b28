"""A trainer's weight-update groups on every rank: SGLang's ``init_weights_update_group``,
``update_weights_from_distributed`` and ``destroy_weights_update_group`` as engine controls.

An RL trainer (its group's rank 0) broadcasts the weights over a torch.distributed group it shares
with the server. A tensor-parallel server is ``tp`` processes and each is a member (SGLang's ranks
``rank_offset .. rank_offset + tp - 1`` of ``world_size``): each takes every broadcast and keeps its
own shard. Only rank 0 hears the HTTP call, so the call is a message on the core's queue
(``messages.WeightGroupCall``); rank 0's plan carries its ``spec`` and at that step boundary every
rank runs this same code, at world size 1 and N:

- the rank's own part (the rendezvous, or the broadcasts into fresh buffers) runs on a helper
  thread, bounded by the call's ``timeout_s``, while the step thread gathers one word per rank
  every heartbeat (working / done / failed): no rank waits in a collective of the engine's own
  group past the heartbeat, however long the trainer takes;
- once every rank is done they agree: a join that failed on any rank is undone on all (the group
  exists on every rank or on none); a receive that failed on any rank (a broadcast that timed
  out, a peer gone) destroys the group everywhere (init it again) and writes nothing; otherwise
  the received tensors are one update through its own agreement (``WeightSync.apply``: each
  rank checks them and cuts its shard, then every rank writes or none does).

Generation waits at that boundary meanwhile, as SGLang's scheduler does for these calls, for at
most ``timeout_s`` per wait. The groups come from the model's backend adapter
(``join_weight_group``): the engine imports no framework.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from .. import registry
from .messages import resolve
from .weight_sync import WeightSync

_WORKING, _DONE, _FAILED = 0, 1, 2  # a rank's word while the calls run
_END = object()  # the receive is over: no more tensors arrive


class _Checks:
    """The received tensors checked one by one as they arrive (``Checker``), on the step thread while
    the next ones are still on the wire, and with ``stage`` laid out as the model keeps them
    (``Checker.staging``): the check (a pass over every byte) and the transposition cost the update
    little time of its own. A bad tensor stops the checking; ``finish()`` raises its error."""

    def __init__(self, model, stage: bool):
        self.arrived: "queue.Queue" = queue.Queue()
        self.error: Optional[BaseException] = None
        self.over = False
        source = getattr(model, "weight_source", None)
        try:
            self.checker = None if source is None else source.checker(model)
            if stage and self.checker is not None:
                self.checker.staging()
        except Exception as error:
            self.error = error

    def run(self, seconds: float) -> None:
        """Check what arrives for up to ``seconds``, or until the receive is over."""
        until = time.monotonic() + seconds
        while not self.over:
            try:
                item = self.arrived.get(timeout=max(until - time.monotonic(), 0))
            except queue.Empty:
                return
            if item is _END:
                self.over = True
            elif self.error is None and self.checker is not None:
                try:
                    self.checker.add(item)
                except Exception as error:
                    self.error = error

    def finish(self):
        if self.error is not None:
            raise self.error
        if self.checker is None:
            raise ValueError("update_weights needs a native model loaded by hyper_gen.load_model")
        return self.checker.finish()


def _kind(failures: List[Tuple[int, str, str]]) -> type:
    kinds = {kind for _, kind, _ in failures}
    if kinds == {"TimeoutError"}:
        return TimeoutError
    return ValueError if kinds == {"ValueError"} else RuntimeError


class WeightGroups:
    """This rank's memberships of trainers' weight-update groups, by name (see the module docstring)."""

    def __init__(self, model, weights: WeightSync, heartbeat_s: float):
        self.model, self.weights, self.heartbeat_s = model, weights, heartbeat_s
        self.rank, self.world_size = weights.rank, weights.world_size
        self.groups: Dict[str, object] = {}
        self._spent = None  # the last update's buffers, dropped after its answer

    @property
    def names(self) -> tuple:
        return tuple(sorted(self.groups))

    def apply(self, spec: dict, message, version, written: Callable[[object], None]) -> None:
        """Run rank 0's call ``spec`` here and answer ``message`` (rank 0's; None on the others).
        ``version``: an update's (rank 0's own object; the plan's copy elsewhere). An error past
        the agreements stops a multi-rank engine (the ranks may now differ); one process reports it."""
        try:
            run = {"init_weights_update_group": self._join, "update_weights_from_distributed": self._receive}
            result, error = run.get(spec["call"], self._leave)(spec, version, written)
        except BaseException as error:
            if message is not None:
                resolve(message, error=error)
            if self.world_size > 1:
                raise
            return
        if message is not None:
            resolve(message, result, error)
        self._spent = None

    def close(self) -> None:
        """Leave every group (the engine shuts down)."""
        for name in list(self.groups):
            self.groups.pop(name).destroy()

    # ---- the calls: (result, error), the same on every rank ---------------------------------------
    def _join(self, spec: dict, version, written):
        name = spec["group_name"]
        rank = int(spec["rank_offset"]) + self.rank
        args = (spec["master_address"], spec["master_port"], rank, spec["world_size"], name, spec["backend"])

        def join():  # (a refusal is a failure like any other: every rank still takes part in the agreement)
            if name in self.groups:
                raise ValueError(f"already in weight update group {name!r}: destroy it first")
            adapter_join = getattr(registry.adapter_of(self.model), "join_weight_group", None)
            if adapter_join is None:
                raise ValueError("this model's backend cannot join a torch.distributed weight update group")
            return adapter_join(self.model, *args, spec["timeout_s"])

        group, failures = self._together(join)
        if failures:
            if group is not None:
                group.destroy()
            return None, self._error(failures, f"joining weight update group {name!r}")
        self.groups[name] = group
        return None, None

    def _receive(self, spec: dict, version, written):
        name = spec["group_name"]
        group = self.groups.get(name)
        specs = list(zip(spec["names"], spec["dtypes"], spec["shapes"]))
        # (a flattened bucket arrives whole: nothing to overlap, so no staging, which would copy twice)
        checks = None if spec["drop"] else _Checks(self.model, stage=not spec["flattened"])

        def receive():
            if group is None:
                raise ValueError(f"unknown weight update group {name!r}")
            arrived = None if checks is None else checks.arrived.put
            return group.receive(specs, spec["timeout_s"], spec["flattened"], arrived)

        weights, failures = self._together(receive, checks)
        if failures:  # the group's state is unknown (a broadcast half done): gone on every rank
            if group is not None:
                del self.groups[name]
                group.destroy()
            return None, self._error(failures, f"receiving the update over group {name!r}")
        if spec["drop"]:
            return 0, None
        update = self.weights.message(self.model, weights, version, defer=True, checked=checks.finish)
        self._spent = [weights, update]  # freed once the caller has its answer (2.9 GB of buffers: ~1 s)
        del weights
        self.weights.apply({"version": update.key, "names": None}, update, lambda seconds: None, written)
        error = update.future.exception()
        return (None, error) if error is not None else (update.future.result(), None)

    def _leave(self, spec: dict, version, written):
        group = self.groups.pop(spec["group_name"], None)
        if group is None:
            return None, ValueError(f"unknown weight update group {spec['group_name']!r}")
        group.destroy()
        return None, None

    # ---- every rank together ------------------------------------------------------------------
    def _together(self, work: Callable[[], object], checks: Optional["_Checks"] = None):
        """``work()`` on a helper thread of every rank, the ranks gathering a word each heartbeat until
        all are done: (this rank's result, [(rank, error kind, message)] of every rank it failed on).
        ``checks``: meanwhile this thread checks each tensor ``work`` puts in ``checks.arrived``."""
        box: dict = {}
        done = threading.Event()

        def run():
            try:
                box["result"] = work()
            except BaseException as error:  # (a timeout, a peer gone): every rank hears of it below
                box["error"] = error
            finally:
                done.set()
                if checks is not None:
                    checks.arrived.put(_END)

        thread = threading.Thread(target=run, name="hyper_gen-weight-group", daemon=True)
        thread.start()
        while True:
            if checks is None:
                done.wait(self.heartbeat_s)
            else:
                checks.run(self.heartbeat_s)
            over = done.is_set() and (checks is None or checks.over)  # (every arrived tensor checked)
            word = _FAILED if over and "error" in box else _DONE if over else _WORKING
            words = self.weights.gather(word)
            if _WORKING not in words:
                break
        failed = [r for r, w in enumerate(words) if w == _FAILED]
        error = box.get("error")
        text = "" if error is None else f"{type(error).__name__}\n{error}"
        told = [t.split("\n", 1) for t in self.weights.told(failed, text)] if failed else []
        return box.get("result"), [(r, kind, why) for r, (kind, why) in zip(failed, told)]

    def _error(self, failures: List[Tuple[int, str, str]], what: str) -> BaseException:
        kind = _kind(failures)
        if self.world_size == 1:
            return kind(failures[0][2])
        reasons = "; ".join(f"rank {r}: {why}" for r, _, why in failures)
        return kind(f"{what} failed on {reasons}")


__all__ = ["WeightGroups"]
