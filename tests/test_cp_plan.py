"""hyper_gen.parallel.cp_plan: which positions each context-parallel rank prefills and caches."""

import pytest

from hyper_gen.parallel.cp_plan import CPPlan, Mesh


def slices(layout):
    return [layout.slice_of(r) for r in range(layout.cp)]


def test_slices_are_whole_chunks_from_position_zero_the_last_one_partial():
    assert slices(CPPlan(2, 0).layout(70)) == [(0, 64), (64, 70)]
    assert slices(CPPlan(2, 1).layout(200)) == [(0, 128), (128, 200)]
    assert slices(CPPlan(2, 0).layout(2048)) == [(0, 1024), (1024, 2048)]
    assert slices(CPPlan(2, 0).layout(129)) == [(0, 128), (128, 129)]  # 3 chunks: the first rank gets 2
    assert slices(CPPlan(3, 0).layout(300)) == [(0, 128), (128, 256), (256, 300)]
    layout = CPPlan(2, 0).layout(200)
    assert layout.sharded and layout.owner == 1 and layout.last_rank == 1 and layout.longest == 128


def test_fewer_chunks_than_ranks_is_a_replicated_prefill():
    layout = CPPlan(2, 0).layout(1)  # a prompt shorter than the number of ranks
    assert not layout.sharded and slices(layout) == [(0, 1), (1, 1)]
    layout = CPPlan(4, 0).layout(100)
    assert not layout.sharded and slices(layout) == [(0, 64), (64, 100), (100, 100), (100, 100)]
    assert CPPlan(2, 0).layout(64).sharded is False and CPPlan(2, 0).layout(65).sharded is True


def test_the_owner_caches_every_decode_token_and_the_others_their_slice():
    layout = CPPlan(2, 0).layout(70)
    assert layout.cached_columns(0, 80) == (0, 64)
    assert layout.cached_columns(1, 80) == (64, 80)
    assert layout.static_capacity(0, 90) == 64 and layout.static_capacity(1, 90) == 26
    short = CPPlan(2, 0).layout(3)
    assert short.cached_columns(1, 5) == (3, 5) and short.static_capacity(1, 3) == 0


def test_mesh_puts_tensor_parallel_ranks_innermost():
    mesh = Mesh(tp=2, cp=2)
    assert [mesh.coordinates(r) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert mesh.tp_groups() == [[0, 1], [2, 3]] and mesh.cp_groups() == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"rank must be in \[0, tp \* cp = 4\)"):
        mesh.coordinates(4)


@pytest.mark.parametrize("cp", [0, -2, 1.5, "2", True, None])
def test_bad_cp_values(cp):
    with pytest.raises(ValueError, match="cp must be an int >= 1"):
        CPPlan(cp, 0)
    with pytest.raises(ValueError, match="cp must be an int >= 1"):
        Mesh(1, cp)


def test_bad_rank_width_and_plan_type():
    with pytest.raises(ValueError, match=r"rank must be in \[0, cp=2\)"):
        CPPlan(2, 2)
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        CPPlan(2, 0).layout(0)
    with pytest.raises(TypeError, match="cp_plan must be a hyper_gen.parallel.cp_plan.CPPlan or None"):
        CPPlan.resolve((2, 0))
    assert CPPlan.resolve(None) == CPPlan(1, 0)
