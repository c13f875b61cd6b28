"""MindSpore's compiled one-token blocks (the default; ``HYPER_GEN_MINDSPORE_JIT=0`` turns them off)
give the tokens and float64 logits PyNative gives for the same batch: the switch is read at import,
so each run is its own process. The two are one code path: a PyNative step calls the functions a
compiled step jits. And a compiled graph computes with each call's own input layout."""

import json
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from launch import REPO, _env
from mindspore import mint

SCRIPT = r"""
import json, sys
import numpy as np
from hyper_gen import generate, load_model
from hyper_gen.demo import demo_model_path
from hyper_gen.backends.mindspore.compile import COMPILED_DECODE
model = load_model(demo_model_path(), backend="mindspore", dtype="float64")
model.decode_compile_after = 1  # a dynamic cache's steps compiled from the first
ids = np.array([[0, 0, 85, 72, 89, 3, 20, 21, 22, 32], [85, 72, 89, 3, 24, 23, 22, 21, 20, 32]])
mask = (np.arange(10)[None, :] >= np.array([[2], [0]])).astype(np.int64)
runs = {}
for cache in sys.argv[1:]:
    out = generate(model, ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True, output_logits=True,
                   cache_implementation=cache)
    runs[cache] = {"compiled": COMPILED_DECODE, "tokens": out.sequences.asnumpy().tolist(),
                   "logits": [l.asnumpy().astype(float).tolist() for l in out.logits]}
print(json.dumps(runs))
"""


CACHES = ["static", "dynamic"]  # one graph a step / one per stretch between attention cores


def _run(compiled: bool):
    """One fresh process per switch value, generating with each cache kind in turn (a model's static
    and dynamic runs compile graphs of their own: the second run's are not the first's)."""
    env = dict(_env(), HYPER_GEN_MINDSPORE_JIT="1" if compiled else "0")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *CACHES], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
    """{True: compiled, False: PyNative} runs, each {cache kind: result}: two processes, not four."""
    return {compiled: _run(compiled) for compiled in (True, False)}


@pytest.mark.parametrize("cache", CACHES)
def test_compiled_decode_equals_pynative(runs, cache):
    compiled, pynative = runs[True][cache], runs[False][cache]
    assert compiled["compiled"] is True and pynative["compiled"] is False
    assert compiled["tokens"] == pynative["tokens"]
    difference = np.abs(np.array(compiled["logits"]) - np.array(pynative["logits"])).max()
    assert difference < 1e-9, difference


def _transpose_last(x):
    return mint.transpose(x, 1, 2)


def test_a_compiled_graph_reads_each_calls_layout():
    """MindSpore 2.10 reuses a graph for a same-shape input whatever its strides, and a view op in it
    read a contiguous tensor after a transposed view with the view's strides (the in-flight engine's
    join / drop hand the Gated DeltaNet graph contiguous conv states after its own view outputs):
    ``jitted`` graphs are called with contiguous tensors only."""
    from hyper_gen.backends.mindspore.compile import jitted

    graph = jitted(_transpose_last)
    data = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    view = ms.Tensor(data).swapaxes(1, 2)  # (2, 3, 4), strides (12, 1, 3)
    contiguous = ms.Tensor(np.ascontiguousarray(data.transpose(0, 2, 1)))
    assert not view.is_contiguous() and contiguous.is_contiguous()
    for x in (view, contiguous, view, contiguous):
        np.testing.assert_array_equal(graph(x).asnumpy(), data)


def test_compiled_blocks_give_a_row_the_same_result_in_any_batch(tmp_path):
    """Each compiled one-token block, and a segment graph of them, on the tiny test checkpoint: row
    0's outputs alone and among 1 or 4 other rows agree to float32 rounding (no row sees another's
    data). On the Intel hosts measured they are bitwise the same (every product's inner size <
    256); on an AMD EPYC MindSpore's CPU kernels round a row differently by batch size (up to ~7e-7
    here), and at inner sizes >= 256 a one-row MatMul takes another path on any host
    (docs/performance.md)."""
    from qwen_checkpoints import make_checkpoint

    from hyper_gen.backends.mindspore import layers
    from hyper_gen.backends.mindspore.compile import jitted
    from hyper_gen.backends.mindspore.decode import segment_rows
    from hyper_gen.backends.mindspore.gated_deltanet import delta_step_rows
    from hyper_gen.models.loading import load_model

    model = load_model(make_checkpoint(tmp_path, "dense", "float32"), backend="mindspore")
    delta = next(layer for layer in model.layers if not layer.is_attention)
    attention = next(layer for layer in model.layers if layer.is_attention)
    mix, att = delta.mixer, attention.mixer
    rng = np.random.default_rng(0)

    def rows(*shape, scale=1.0):
        return (rng.standard_normal((5,) + shape) * scale).astype(np.float32)

    x, out = rows(model.config.hidden_size), rows(att.num_heads * att.head_dim)
    conv = rows(mix.conv_dim, mix.kernel - 1)
    gate = 1 / (1 + np.exp(-rows(att.num_heads * att.head_dim)))
    state = rows(mix.num_v_heads, mix.head_k_dim, mix.head_v_dim, scale=0.3)
    cos, sin = rows(1, att.head_dim), rows(1, att.head_dim)

    def states(b):
        return ms.Tensor(x[:b]), ms.Tensor(conv[:b]), ms.Tensor(state[:b]), delta.eps

    # a Gated DeltaNet layer and the head as one graph (a dynamic cache's last segment)
    mlp_at, head_at = 3 + len(mix.step_weights(1)), 6 + len(mix.step_weights(1))
    steps = (("delta", 0, mix.step_sizes, 0), ("mlp", mlp_at, (), delta.mlp.inter))
    steps += (("head", head_at, 2 + len(model.lm_head), 0),)
    segment = jitted(segment_rows, steps)
    blocks = {
        "delta_step": (jitted(delta_step_rows, mix.step_sizes), lambda b: states(b) + mix.step_weights(b)),
        "attention_pre": (
            jitted(layers.attention_pre_rows, att.step_sizes),
            lambda b: (ms.Tensor(x[:b]), attention.eps, *att.step_weights(), ms.Tensor(cos[:b]), ms.Tensor(sin[:b])),
        ),
        "attention_out": (
            jitted(layers.attention_out_rows),
            lambda b: (ms.Tensor(out[:b]), ms.Tensor(gate[:b]), att.o_t),
        ),
        "mlp": (
            jitted(layers.mlp_rows, delta.mlp.inter),
            lambda b: (ms.Tensor(x[:b]), delta.eps, *delta.mlp.step_weights()),
        ),
        "head": (jitted(layers.head_rows), lambda b: (ms.Tensor(x[:b]), model.eps, model.norm, *model.lm_head)),
        "segment": (
            lambda *args: (lambda logits, q, k, v, gate, states: (logits, *states))(*segment(*args)),
            lambda b: (
                (ms.Tensor(x[:b]), None, None, *states(b)[1:], *mix.step_weights(b))
                + (delta.eps, *delta.mlp.step_weights(), model.eps, model.norm, *model.lm_head)
            ),
        ),
    }
    for name, (block, arguments) in blocks.items():
        results = [block(*arguments(b)) for b in (1, 2, 5)]
        alone, *batched = [[o.asnumpy()[0] for o in (r if isinstance(r, tuple) else (r,))] for r in results]
        for outputs in batched:
            for a, b in zip(alone, outputs):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6, err_msg=name)


def test_a_pynative_decode_step_calls_the_functions_a_compiled_step_jits(monkeypatch):
    """The decode step is written once: held back by the compile gate, a one-token step calls the
    same functions with the same static sizes that a compiled step jits (``compile.block``), block
    by block, and the layers' ``construct`` sees only the prefill. Same tokens either way."""
    from hyper_gen import generate
    from hyper_gen.backends.mindspore import compile, decode, gated_deltanet, layers
    from hyper_gen.backends.mindspore.models import qwen3_5
    from hyper_gen.demo import demo_model_path
    from hyper_gen.models.loading import load_model

    model = load_model(demo_model_path(), backend="mindspore", dtype="float32")
    model.segments_decode = False  # compiled steps block by block too, as under TP, MoE or CP
    calls, lengths = [], []

    def block(function, *static, compiled):
        calls.append((function, static, compiled))
        return compile.block(function, *static, compiled=compiled)

    monkeypatch.setattr(decode, "block", block)
    monkeypatch.setattr(qwen3_5, "block", block)  # the LM head
    for cell in (layers.GatedAttention, gated_deltanet.GatedDeltaNet):
        construct = cell.construct
        monkeypatch.setattr(
            cell, "construct", lambda self, x, b, s, *rest, c=construct: lengths.append(s) or c(self, x, b, s, *rest)
        )
    ids = np.array([[85, 72, 89, 3, 20, 21, 22, 32]])
    runs = []
    for after in (10**9, 1):  # every step PyNative, then every step compiled
        model.decode_compile_after = after
        calls.clear()
        lengths.clear()
        tokens = generate(model, ids, max_new_tokens=4, cache_implementation="dynamic", eos_token_id=None)
        assert set(lengths) == {ids.shape[1]} and len(lengths) == len(model.layers)  # the prefill only
        runs.append((list(calls), tokens.asnumpy()))
    (pynative, pynative_tokens), (compiled, compiled_tokens) = runs
    assert [(f, s) for f, s, _ in pynative] == [(f, s) for f, s, _ in compiled]
    functions = {f for f, _, _ in pynative}
    assert functions == {
        gated_deltanet.delta_step_rows,
        layers.attention_pre_rows,
        layers.attention_out_rows,
        layers.mlp_rows,
        layers.head_rows,
    }
    assert not any(c for _, _, c in pynative)
    assert [c for _, _, c in compiled] == [False] + [True] * (len(compiled) - 1)  # all but the prefill's head
    assert all((f, *s) in compile._COMPILED for f, s, c in compiled if c)
    np.testing.assert_array_equal(pynative_tokens, compiled_tokens)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_a_dense_decode_step_launches_one_graph_or_one_per_stretch_between_attention_cores(cache, monkeypatch):
    """A dense tp-1 model's decode step is one compiled graph with a static cache (its writes and
    attention in the graph too), and with a dynamic cache one from each attention core to the next
    plus one for the last stretch and the LM head: not one per block. The launches, not the
    kernels, were most of a small model's step (docs/performance.md)."""
    from hyper_gen import generate
    from hyper_gen.backends.mindspore import decode
    from hyper_gen.demo import demo_model_path
    from hyper_gen.models.loading import load_model

    model = load_model(demo_model_path(), backend="mindspore", dtype="float32")
    model.decode_compile_after = 1  # a dynamic cache's steps compiled from the first
    attention_layers = sum(layer.is_attention for layer in model.layers)
    assert 0 < attention_layers < len(model.layers)
    launched, segment = [], decode.run_segment
    monkeypatch.setattr(decode, "run_segment", lambda steps, *rest: launched.append(steps) or segment(steps, *rest))
    ids = np.array([[85, 72, 89, 3, 20, 21, 22, 32]])
    generate(model, ids, max_new_tokens=4, cache_implementation=cache)  # a prefill and 3 one-token steps
    per_step = 1 if cache == "static" else attention_layers + 1
    assert len(launched) == 3 * per_step
    kinds = [kind for steps in launched[:per_step] for kind, *_ in steps]
    assert kinds.count("delta") == len(model.layers) - attention_layers and kinds[-1] == "head"
    assert kinds.count("attend") == (attention_layers if cache == "static" else 0)


def test_a_dynamic_caches_batch_size_runs_compiled_once_seen_enough(monkeypatch):
    """The in-flight engine's batch changes size as requests join and leave; compiling costs
    ~0.5-2.5 s a size, so a dynamic cache's steps run PyNative until their batch size has been
    decoded ``decode_compile_after`` times, and compiled from then on. Static caches (generate's
    default) compile at once. Same tokens either way."""
    from hyper_gen import generate
    from hyper_gen.backends.mindspore import decode
    from hyper_gen.backends.mindspore.compile import DYNAMIC_COMPILE_AFTER
    from hyper_gen.demo import demo_model_path
    from hyper_gen.models.loading import load_model

    model = load_model(demo_model_path(), backend="mindspore", dtype="float32")
    assert model.decode_compile_after == DYNAMIC_COMPILE_AFTER > 1
    model.decode_compile_after = 3
    per_step = sum(layer.is_attention for layer in model.layers) + 1  # segment graphs a dynamic step
    launched, segment = [], decode.run_segment
    monkeypatch.setattr(decode, "run_segment", lambda steps, *rest: launched.append(steps) or segment(steps, *rest))
    one = np.array([[85, 72, 89, 3, 20, 21, 22, 32]])
    two = np.array([[85, 72, 89, 3, 20, 21, 22, 32], [85, 72, 89, 3, 24, 23, 22, 21]])

    def decode_launches(ids, cache, new_tokens=6):  # a prefill and new_tokens - 1 one-token steps
        launched.clear()
        tokens = generate(model, ids, max_new_tokens=new_tokens, cache_implementation=cache, eos_token_id=None)
        return len(launched) // per_step if cache == "dynamic" else len(launched), tokens.asnumpy()

    compiled_steps, mixed = decode_launches(one, "dynamic")
    assert compiled_steps == 5 - 2  # PyNative for the first two steps at batch 1
    compiled_steps, compiled = decode_launches(one, "dynamic")
    assert compiled_steps == 5  # batch 1 is past the count: all five
    assert decode_launches(two, "dynamic")[0] == 3  # a new size waits again
    assert decode_launches(two, "static")[0] == 5  # a static cache compiles at once (one graph a step)
    model.decode_compile_after = 10**9  # a count never reached: every step PyNative
    compiled_steps, pynative = decode_launches(one, "dynamic")
    assert compiled_steps == 0
    np.testing.assert_array_equal(mixed, compiled)
    np.testing.assert_array_equal(mixed, pynative)
