"""MindSpore's compiled one-token blocks (the default; ``HYPER_GEN_MINDSPORE_JIT=0`` turns them off)
give the tokens and float64 logits PyNative gives for the same batch: the switch is read at import,
so each run is its own process. And a compiled graph computes with each call's own input layout."""

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
from hyper_gen.backends.mindspore.models import qwen3_5
model = load_model(demo_model_path(), backend="mindspore", dtype="float64")
model.decode_compile_after = 1  # a dynamic cache's steps compiled from the first
ids = np.array([[0, 0, 85, 72, 89, 3, 20, 21, 22, 32], [85, 72, 89, 3, 24, 23, 22, 21, 20, 32]])
mask = (np.arange(10)[None, :] >= np.array([[2], [0]])).astype(np.int64)
out = generate(model, ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True, output_logits=True,
               cache_implementation=sys.argv[1])
print(json.dumps({"compiled": qwen3_5.COMPILED_DECODE, "tokens": out.sequences.asnumpy().tolist(),
                  "logits": [l.asnumpy().astype(float).tolist() for l in out.logits]}))
"""


def _run(compiled: bool, cache: str):
    env = dict(_env(), HYPER_GEN_MINDSPORE_JIT="1" if compiled else "0")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, cache], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cache", ["static", "dynamic"])  # one graph a step / one per stretch between attention cores
def test_compiled_decode_equals_pynative(cache):
    compiled, pynative = _run(True, cache), _run(False, cache)
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
    ``_compiled`` graphs are called with contiguous tensors only."""
    from hyper_gen.backends.mindspore.models import qwen3_5

    graph = qwen3_5._compiled(("test_transpose_last",), lambda: _transpose_last)
    data = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    view = ms.Tensor(data).swapaxes(1, 2)  # (2, 3, 4), strides (12, 1, 3)
    contiguous = ms.Tensor(np.ascontiguousarray(data.transpose(0, 2, 1)))
    assert not view.is_contiguous() and contiguous.is_contiguous()
    for x in (view, contiguous, view, contiguous):
        np.testing.assert_array_equal(graph(x).asnumpy(), data)


def test_compiled_blocks_give_a_row_the_same_result_in_any_batch(tmp_path):
    """Each compiled one-token block, on the tiny test checkpoint: row 0's outputs alone and among
    1 or 4 other rows agree to float32 rounding (no row sees another's data). On the Intel hosts
    measured they are bitwise the same (every product's inner size < 256); on an AMD EPYC
    MindSpore's CPU kernels round a row differently by batch size (up to ~7e-7 here), and at
    inner sizes >= 256 a one-row MatMul takes another path on any host (docs/performance.md)."""
    from qwen_checkpoints import make_checkpoint

    from hyper_gen.backends.mindspore.models import qwen3_5
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
    delta_sizes = (mix.conv_dim, mix.value_dim, mix.num_k_heads, mix.num_v_heads, mix.head_k_dim, mix.head_v_dim)
    delta_sizes += (mix.acc,)
    attention_sizes = (att.num_heads, att.num_kv_heads, att.head_dim, att.acc)
    blocks = {
        "delta_layer": (
            qwen3_5._compiled(
                ("delta_layer", delta_sizes, delta.mlp.inter),
                lambda: qwen3_5._delta_layer_kernel(delta_sizes, delta.mlp.inter),
            ),
            lambda b: (
                (ms.Tensor(x[:b]), ms.Tensor(conv[:b]), ms.Tensor(state[:b]), delta.eps, mix.in_proj_t)
                + (mix.conv_t, qwen3_5._ones((b, 1, mix.kernel), mix.conv_t.dtype), mix.a, mix.dt_bias, mix.out_t)
                + (mix.l2_eps, mix.gated_norm_eps, delta.mlp.up_gate_t, delta.mlp.down_t)
            ),
        ),
        "attention_pre": (
            qwen3_5._compiled(
                ("attention_pre", attention_sizes), lambda: qwen3_5._attention_pre_kernel(attention_sizes)
            ),
            lambda b: (
                (ms.Tensor(x[:b]), attention.eps, att.qkv_t, att.eps, att.qk_norm, att.rotate)
                + (ms.Tensor(cos[:b]), ms.Tensor(sin[:b]))
            ),
        ),
        "attention_post": (
            qwen3_5._compiled(
                ("attention_post", attention.mlp.inter), lambda: qwen3_5._attention_post_kernel(attention.mlp.inter)
            ),
            lambda b: (
                (ms.Tensor(x[:b]), ms.Tensor(out[:b]), ms.Tensor(gate[:b]), att.o_t, attention.eps)
                + (attention.mlp.up_gate_t, attention.mlp.down_t)
            ),
        ),
        "head": (
            qwen3_5._compiled(("head",), qwen3_5._head_kernel),
            lambda b: (ms.Tensor(x[:b]), model.eps, model.norm, *model.lm_head),
        ),
    }
    for name, (block, arguments) in blocks.items():
        results = [block(*arguments(b)) for b in (1, 2, 5)]
        alone, *batched = [[o.asnumpy()[0] for o in (r if isinstance(r, tuple) else (r,))] for r in results]
        for outputs in batched:
            for a, b in zip(alone, outputs):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_a_dense_decode_step_launches_one_graph_or_one_per_stretch_between_attention_cores(cache, monkeypatch):
    """A dense tp-1 model's decode step is one compiled graph with a static cache (its writes and
    attention in the graph too), and with a dynamic cache one from each attention core to the next
    plus one for the last stretch and the LM head: not one per block. The launches, not the
    kernels, were most of a small model's step (docs/performance.md)."""
    from hyper_gen import generate
    from hyper_gen.backends.mindspore.models import qwen3_5
    from hyper_gen.demo import demo_model_path
    from hyper_gen.models.loading import load_model

    model = load_model(demo_model_path(), backend="mindspore", dtype="float32")
    model.decode_compile_after = 1  # a dynamic cache's steps compiled from the first
    attention_layers = sum(layer.is_attention for layer in model.layers)
    assert 0 < attention_layers < len(model.layers)
    launched, segment = [], qwen3_5._run_segment
    monkeypatch.setattr(qwen3_5, "_run_segment", lambda steps, *rest: launched.append(steps) or segment(steps, *rest))
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
    from hyper_gen.backends.mindspore.models import qwen3_5
    from hyper_gen.demo import demo_model_path
    from hyper_gen.models.loading import load_model

    model = load_model(demo_model_path(), backend="mindspore", dtype="float32")
    assert model.decode_compile_after == qwen3_5.DYNAMIC_COMPILE_AFTER > 1
    model.decode_compile_after = 3
    per_step = sum(layer.is_attention for layer in model.layers) + 1  # segment graphs a dynamic step
    launched, segment = [], qwen3_5._run_segment
    monkeypatch.setattr(qwen3_5, "_run_segment", lambda steps, *rest: launched.append(steps) or segment(steps, *rest))
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
