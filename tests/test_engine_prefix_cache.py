"""The paged engine's cache on hybrid (Gated DeltaNet + attention) dense and MoE checkpoints, torch and
MindSpore: a prefix hit, a chunked prefill and a preemption each give generate()'s tokens, and float64
logits within 1e-9 of the engine with prefix caching off; the budget refuses what can never fit.

A hybrid prefix resumes only where its recurrent state was snapshotted (every ``state_snapshot_blocks``
blocks): the hits asserted here are whole snapshot intervals, never a block in between.
"""

import numpy as np
import pytest
from qwen_checkpoints import make_checkpoint

from hyper_gen import generate, load_model
from hyper_gen.engine import Engine, SamplingParams

BACKENDS = ["torch", "mindspore"]
KINDS = ["dense", "moe"]
VOCAB = 97  # qwen_checkpoints' tiny vocabulary
_MODELS = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("prefix_cache")


def model_of(root, kind, backend, dtype="float32"):
    key = (kind, backend, dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(make_checkpoint(root, kind, "float32"), backend=backend, dtype=dtype)
    return _MODELS[key]


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.detach().numpy()


def reference(model, prompt, max_new_tokens):
    out = host(generate(model, [prompt], max_new_tokens=max_new_tokens, eos_token_id=None))
    return out[0, len(prompt) :].tolist()


def shared_prompts(count, prefix_len, tail_len, seed=0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(8, VOCAB, prefix_len).tolist()
    return [prefix + rng.integers(8, VOCAB, tail_len).tolist() for _ in range(count)]


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_hits_give_generates_tokens(root, kind, backend, one_torch_thread):
    """One system prompt of 80 tokens, different tails: after the first request every later one hits
    the 64 positions that end at a snapshot (16-position blocks, a snapshot every 4), and its tokens
    are generate()'s for its prompt alone."""
    model = model_of(root, kind, backend)
    prompts = shared_prompts(4, 80, 7)
    with Engine(model, block_size=16, state_snapshot_blocks=4) as engine:
        first = engine.submit(prompts[0], greedy(6)).result(timeout=120)
        assert engine.stats()["prefix_cache_hits"] == 0
        outs = [engine.submit(p, greedy(6)) for p in prompts[1:]]
        outs = [first] + [s.result(timeout=120) for s in outs]
        stats = engine.stats()
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)
    assert stats["prefix_cache_hits"] == 64 * (len(prompts) - 1)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(model, prompt, 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_n_choices_share_the_prompt_blocks_and_sample_as_generate(root, backend, one_torch_thread):
    """n=3 seeded choices over a cached prefix: each draws as generate's row i with that seed."""
    model = model_of(root, "dense", backend)
    prompts = shared_prompts(2, 70, 5, seed=3)
    settings = dict(temperature=1.3, top_k=10, seed=99)
    with Engine(model, block_size=16, state_snapshot_blocks=4) as engine:
        engine.submit(prompts[0], greedy(2)).result(timeout=120)
        out = engine.submit(prompts[1], SamplingParams(n=3, max_tokens=5, ignore_eos=True, **settings))
        out = out.result(timeout=120)
        assert engine.stats()["prefix_cache_hits"] == 64
    ref = host(
        generate(
            model,
            [prompts[1]],
            max_new_tokens=5,
            do_sample=True,
            temperature=1.3,
            top_k=10,
            seed=99,
            num_return_sequences=3,
            eos_token_id=None,
        )
    )[:, len(prompts[1]) :]
    assert [c.token_ids for c in out.outputs] == ref.tolist()


def _logits(engine):
    """Record the float64 logits the engine chooses each token from (before the cast to float32)."""
    seen = []
    scores = engine._runner._scores

    def recording(logits):
        seen.append(np.asarray(host(logits), dtype=np.float64))
        return scores(logits)

    engine._runner._scores = recording
    return seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_logits_with_a_hit_are_the_cache_off_engines(root, kind, backend, one_torch_thread):
    model = model_of(root, kind, backend, "float64")
    prompts = shared_prompts(2, 130, 9, seed=5)
    runs = {}
    for caching in (True, False):
        with Engine(model, enable_prefix_caching=caching, block_size=16, state_snapshot_blocks=4) as engine:
            engine.submit(prompts[0], greedy(3)).result(timeout=120)
            seen = _logits(engine)
            out = engine.submit(prompts[1], greedy(5)).result(timeout=120)
            runs[caching] = (out.outputs[0].token_ids, np.concatenate(seen), engine.stats()["prefix_cache_hits"])
    assert runs[True][2] == 128 and runs[False][2] == 0
    assert runs[True][0] == runs[False][0]
    np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=0, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_of_a_long_prompt_while_rows_decode(root, backend, one_torch_thread):
    """max_num_batched_tokens=24: a 150-token prompt is prefilled over several steps while two rows
    decode; every request's tokens are generate()'s."""
    model = model_of(root, "dense", backend)
    rng = np.random.default_rng(11)
    short = [rng.integers(8, VOCAB, 6).tolist() for _ in range(2)]
    long = rng.integers(8, VOCAB, 150).tolist()
    with Engine(model, max_num_batched_tokens=24, block_size=8) as engine:
        streams = [engine.submit(p, greedy(30)) for p in short]
        next(iter(streams[0]))
        streams.append(engine.submit(long, greedy(4)))
        outs = [s.result(timeout=180) for s in streams]
    for prompt, out, n in zip(short + [long], outs, (30, 30, 4)):
        assert out.outputs[0].token_ids == reference(model, prompt, n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_preempted_rows_finish_with_generates_tokens(root, backend, one_torch_thread):
    """A pool of 12 blocks of 4 positions for 4 rows that grow to 8 blocks each: the youngest rows are
    preempted and recomputed, and every request still gives generate()'s tokens."""
    model = model_of(root, "dense", backend)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(8, VOCAB, 9).tolist() for _ in range(4)]
    probe = Engine(model, block_size=4).stats()
    per_block, live = probe["bytes_per_block"], probe["state_slot_bytes"]  # (the budget holds the live states too)
    budget = 12 * per_block + live + 1
    with Engine(model, block_size=4, cache_memory_bytes=budget, enable_prefix_caching=False) as engine:
        assert engine.stats()["blocks_total"] == 12
        outs = [s.result(timeout=180) for s in [engine.submit(p, greedy(20)) for p in prompts]]
        stats = engine.stats()
    assert stats["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(model, prompt, 20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_that_can_never_fit_is_refused_at_submit(root, backend):
    model = model_of(root, "dense", backend)
    probe = Engine(model, block_size=4, enable_prefix_caching=False).stats()
    budget = 5 * probe["bytes_per_block"] + probe["state_slot_bytes"]
    with Engine(model, block_size=4, cache_memory_bytes=budget, enable_prefix_caching=False) as engine:
        with pytest.raises(ValueError, match=r"cache_memory_bytes=\d+") as refused:
            engine.submit(list(range(8, 20)), greedy(9))  # 21 positions: 6 blocks of 4
        assert "6 KV cache blocks" in str(refused.value) and "pool of 5" in str(refused.value)
        assert engine.submit(list(range(8, 20)), greedy(8)).result(timeout=60).outputs[0].token_ids


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("block_size", 0, ValueError),
        ("max_num_batched_tokens", -1, ValueError),
        ("cache_memory_bytes", 1.5, ValueError),
        ("enable_prefix_caching", "yes", TypeError),
        ("state_snapshot_blocks", 0, ValueError),
    ],
)
def test_bad_cache_settings_name_the_field(root, field, value, error):
    with pytest.raises(error, match=field):
        Engine(model_of(root, "dense", "torch"), **{field: value})


def test_a_budget_smaller_than_a_block_is_refused(root):
    with pytest.raises(ValueError, match="cache_memory_bytes=10 cannot hold one KV cache block"):
        Engine(model_of(root, "dense", "torch"), cache_memory_bytes=10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_long_row_among_short_ones_decodes_apart_with_the_same_tokens(root, backend, one_torch_thread):
    """A 300-token row and three 5-token rows: torch's attention reads the pool in pieces and the
    short rows sit out the long row's (no padding to 300 positions); MindSpore, which attends over
    gathered K/V, splits the step in two groups by length. Tokens are generate()'s, and the MoE
    routing of each row comes back in its own order."""
    from hyper_gen.engine import runner

    assert [g.tolist() for g in runner.length_groups(np.array([5, 3000, 6, 5]))] == [[0, 3, 2], [1]]
    assert [g.tolist() for g in runner.length_groups(np.array([5, 300, 6, 5]))] == [[0, 1, 2, 3]]  # < 2048 saved
    assert [g.tolist() for g in runner.length_groups(np.array([5, 300, 6, 5]), padding=256)] == [[0, 3, 2], [1]]
    model = model_of(root, "moe", backend)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(8, VOCAB, n).tolist() for n in (5, 300, 6, 5)]
    with Engine(model, enable_prefix_caching=False) as engine:
        run = engine._runner
        run.split_padding = 256  # (the tiny model's context is 512 positions)
        decodes, grouped = [], run._decode_groups  # each decode step's groups: the rows of each
        run._decode_groups = lambda items: decodes.append([g.batch for g in grouped(items)]) or grouped(items)
        pieces = []  # each decode forward's pieces: the rows of each
        if run.paged_columns:
            run.paged_columns = 64
            run.in_place = False  # the pieces (the in-place kernel reads only each row's own slots)
            attend = run.ops.paged_attention
            run.ops.paged_attention = lambda q, k, v, parts, partial: (
                (pieces.append([p.shape[0] for p in parts]) if q.shape[2] == 1 else None)
                or attend(q, k, v, parts, partial)
            )
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_routed_experts=True)
        outs = [s.result(timeout=120) for s in [engine.submit(p, params) for p in prompts]]
    if backend == "torch":
        assert [4] in decodes and all(len(groups) == 1 for groups in decodes), decodes
        # once all four decode, every row reads the first piece (its first positions) and the last (its
        # own column), and the long row alone reads those between (a step where fewer rows decode,
        # while another is still prefilled, has fewer rows in each piece)
        assert [4, 1, 1, 1, 4] in pieces, pieces
        assert all(max(r[1:-1], default=1) == 1 for r in pieces), pieces
    else:
        assert [3, 1] in decodes, decodes  # the long row alone
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(model, prompt, 6)
        ref = generate(
            model, [prompt], max_new_tokens=6, eos_token_id=None, return_routed_experts=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        np.testing.assert_array_equal(out.outputs[0].routed_experts, ref.routed_experts[0])


def test_max_prefill_tokens_is_the_old_name_of_the_step_budget(root):
    with pytest.warns(DeprecationWarning, match="max_num_batched_tokens"):
        engine = Engine(model_of(root, "dense", "torch"), max_prefill_tokens=64)
    assert engine._scheduler.max_num_batched_tokens == 64
