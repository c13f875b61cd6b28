"""The checks a model port makes of the communication group it loads a shard for, and the subgroups
of a tp x cp mesh, written once.

A port reads its framework's facts (the world's size, this process's rank, the group's) and asks
these; the messages name the plan, the group and how to launch the job, the same on every backend.
"""

from __future__ import annotations

from hyper_gen.parallel.cp_plan import CPPlan, Mesh
from hyper_gen.parallel.tp_plan import TPPlan


def check_tp_group(plan: TPPlan, group, size: int, rank: int, launch: str) -> None:
    """The group the shard sums over (None: the world) must be the plan's ``tp`` ranks, this
    process at ``plan.rank``; ``size`` and ``rank`` are the group's, ``launch`` the launcher's command."""
    where = "the world group" if group is None else f"group {group!r}"
    if size != plan.tp:
        raise ValueError(f"plan tp={plan.tp} but {where} has {size} rank(s): launch {plan.tp} processes ({launch})")
    if rank != plan.rank:
        raise ValueError(f"plan rank={plan.rank} but this process is rank {rank} of {where}")


def check_mesh(plan: TPPlan, cp_plan: CPPlan, world: int, rank: int, launch: str, backend: str) -> Mesh:
    """The world must be the ``tp x cp`` mesh (tp innermost), this process at the plans' coordinates."""
    mesh = Mesh(plan.tp, cp_plan.cp)
    if world != mesh.size:
        raise ValueError(
            f"tp={plan.tp} x cp={cp_plan.cp} needs {mesh.size} ranks (tp * cp) but this process is rank {rank} of a "
            f"{world}-rank world: launch {mesh.size} processes ({launch}) and load with "
            f"hyper_gen.load_model(..., backend={backend!r}, tp={plan.tp}, cp={cp_plan.cp})"
        )
    if mesh.coordinates(rank) != (plan.rank, cp_plan.rank):
        raise ValueError(
            f"plan tp rank {plan.rank}, cp_plan cp rank {cp_plan.rank} but this process is rank {rank}, which the "
            f"mesh (tp innermost) places at tp rank, cp rank {mesh.coordinates(rank)}"
        )
    return mesh


def mesh_groups(plan: TPPlan, cp_plan: CPPlan, rank: int, group, make_group):
    """(tp group, cp group) of world rank ``rank`` in the ``tp x cp`` mesh; at tp 1, ``(group, None)``
    (None: the world group, the one axis of a 1-D mesh). ``group``, when given, is the tp group.
    ``make_group(name, ranks, member)`` is asked for every subgroup, in the same order on every rank
    (torch.distributed needs each rank to make each group; MindSpore makes a group on its members
    only) and returns it, or None; the names are the same on every rank."""
    if plan.tp == 1:
        return group, None
    mesh = Mesh(plan.tp, cp_plan.cp)
    tag = f"hyper_gen_tp{plan.tp}xcp{cp_plan.cp}"
    mine = {}
    for axis, groups in (("tp", mesh.tp_groups()), ("cp", mesh.cp_groups())):
        for index, ranks in enumerate(groups):
            made = make_group(f"{tag}_{axis}{index}", list(ranks), rank in ranks)
            if rank in ranks:
                mine[axis] = made
    return (group if group is not None else mine["tp"]), mine["cp"]


def shard_groups(ops, plan: TPPlan, cp_plan: CPPlan, group, launch: str, backend: str, make_group):
    """(tp group, cp group) a port loads its shard for, every check made first: with cp > 1 the
    world must be the mesh (its subgroups made by ``mesh_groups``), with tp > 1 the tp group must
    be the plan's. ``ops`` answers the world's and the groups' size and rank; ``launch`` is the
    launcher's command for the messages."""
    cp_group = None
    if cp_plan.cp > 1:
        rank = ops.rank()
        check_mesh(plan, cp_plan, ops.world_size(), rank, launch, backend)
        group, cp_group = mesh_groups(plan, cp_plan, rank, group, make_group)
    if plan.tp > 1:
        check_tp_group(plan, group, ops.world_size(group), ops.rank(group), launch)
    return group, cp_group
