"""The parallel attributes a native port's model carries, and the one step of its forward that
reads them, written once for both ports. generate() reads ``parallel_group`` / ``vocab_parallel``
(``model_group``): under tp alone the logits are this rank's vocabulary block, which generate()
gathers; under context parallelism generate() agrees over the whole tp x cp job, and the model
gathers its vocabulary blocks over its tp group itself, so its logits are whole on every rank."""

from __future__ import annotations

from hyper_gen.ops import Ops, Tensor
from hyper_gen.parallel.context_parallel import ContextParallel
from hyper_gen.parallel.cp_plan import CPPlan
from hyper_gen.parallel.tp_plan import TPPlan


def set_parallel(model, plan: TPPlan, group, cp_plan, cp_group, ops: Ops) -> None:
    """``tp_plan``, ``tp_group``, ``cp_plan`` and ``context_parallel`` (None at cp 1) on ``model``,
    and ``parallel_group`` / ``vocab_parallel`` where it runs on more than one rank."""
    model.tp_plan, model.tp_group = plan, group
    model.cp_plan = CPPlan.resolve(cp_plan)
    model.context_parallel = ContextParallel(model.cp_plan, ops, cp_group) if model.cp_plan.cp > 1 else None
    if model.cp_plan.cp > 1:
        model.parallel_group, model.vocab_parallel = None, False
    elif plan.tp > 1:
        model.parallel_group, model.vocab_parallel = group, True


def whole_vocabulary(model, logits: Tensor, ops: Ops) -> Tensor:
    """A tp x cp model's logits with every rank's vocabulary block (padding trimmed); others' as they are."""
    if model.context_parallel is None or model.tp_plan.tp == 1:
        return logits
    return ops.all_gather(logits, axis=-1, group=model.tp_group)[..., : model.vocab_size]
