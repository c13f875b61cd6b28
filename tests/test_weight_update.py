"""``hyper_gen.update_weights`` and ``Engine.update_weights`` (issue 26), torch and MindSpore.

A model updated with a trainer's tensors (HF checkpoint names) is the model ``load_model`` makes of a
checkpoint holding those tensors: float64 logits bitwise equal and the same greedy tokens, for every
weight or one layer's, dense (the demo model) and MoE (a tiny random checkpoint, per-expert and
fused experts). A bad update is refused naming the tensor and leaves the model bitwise unchanged.
The engine applies an update between steps (its own thread, or stepped by the caller); outputs made
after it carry its ``weight_version``, and requests after it decode exactly as generate() on the
updated model.
"""

import os
import re
import shutil
import threading

import numpy as np
import pytest
import torch
from backend_harness import SLOW_ON_MINDSPORE
from demo_task import DEMO_MODEL_DIR
from safetensors.numpy import load_file, save_file

from hyper_gen import generate, load_model, update_weights
from hyper_gen.engine import Engine, SamplingParams

BACKENDS = ["torch", "mindspore"]
PROMPT = [[3, 17, 42, 8, 23, 5, 61, 30]]


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.detach().cpu().numpy()


def checkpoint_tensors(path):
    return load_file(os.path.join(path, "model.safetensors"))


def perturbed(tensors, names=None, seed=1):
    """Every tensor (or those in ``names``) plus small noise, same dtype."""
    rng = np.random.default_rng(seed)
    return {
        k: (v + rng.normal(0, 0.02, v.shape).astype(v.dtype)) if names is None or k in names else v
        for k, v in tensors.items()
    }


def save_like(path, tensors, folder):
    """A checkpoint folder: ``path``'s config / tokenizer files, ``tensors`` as its weights."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(path):
        if name != "model.safetensors" and os.path.isfile(os.path.join(path, name)):
            shutil.copy(os.path.join(path, name), folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return str(folder)


def logits(model, ids=PROMPT):
    if hasattr(model, "construct"):
        import mindspore as ms

        return model(ms.Tensor(np.array(ids, np.int64)))["logits"].asnumpy()
    return model(torch.tensor(ids))["logits"].numpy()


def tokens(model, new=12):
    return host(generate(model, np.array(PROMPT), max_new_tokens=new, do_sample=False))


def assert_same_model(updated, reference):
    np.testing.assert_array_equal(logits(updated), logits(reference))
    np.testing.assert_array_equal(tokens(updated), tokens(reference))


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    from qwen_checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("moe")
    return {
        "moe": make_checkpoint(root, kind="moe"),
        "moe_fused": make_checkpoint(root, kind="moe", fused_experts=True),
    }


def source(kind, moe_paths):
    return DEMO_MODEL_DIR if kind == "demo" else moe_paths[kind]


# ---------------------------------------------------------------------------- the model's weights


@pytest.mark.parametrize("backend", SLOW_ON_MINDSPORE)
@pytest.mark.parametrize(
    "kind,dtype", [("demo", "float64"), ("demo", "float32"), ("moe", "float64"), ("moe_fused", "float64")]
)
def test_every_weight_equals_a_fresh_load(backend, kind, dtype, moe_paths, tmp_path, one_torch_thread):
    path = source(kind, moe_paths)
    new = perturbed(checkpoint_tensors(path))
    model = load_model(path, backend=backend, dtype=dtype, kernels="plain")
    assert update_weights(model, new.items()) == len(new)
    reference = load_model(save_like(path, new, tmp_path / "new"), backend=backend, dtype=dtype, kernels="plain")
    assert_same_model(model, reference)
    # and a second full update (the trainer's next step) on top of the first
    newer = perturbed(checkpoint_tensors(path), seed=2)
    update_weights(model, newer)
    # (plain kernels on both sides: a timed kernel plan may choose other widths under load, which round apart)
    fresh = load_model(save_like(path, newer, tmp_path / "newer"), backend=backend, dtype=dtype, kernels="plain")
    assert_same_model(model, fresh)


@pytest.mark.parametrize("backend", SLOW_ON_MINDSPORE)
@pytest.mark.parametrize("kind", ["demo", "moe"])
def test_one_layers_weights_equal_a_fresh_load(backend, kind, moe_paths, tmp_path, one_torch_thread):
    path = source(kind, moe_paths)
    tensors = checkpoint_tensors(path)
    layer = [k for k in tensors if k.startswith("model.layers.1.")] + ["model.norm.weight"]
    new = perturbed(tensors, set(layer))
    model = load_model(path, backend=backend, dtype="float64", kernels="plain")
    assert update_weights(model, [(k, new[k]) for k in layer]) == len(layer)
    reference = load_model(save_like(path, new, tmp_path / "new"), backend=backend, dtype="float64", kernels="plain")
    assert_same_model(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_framework_tensors_and_bf16(backend, tmp_path, one_torch_thread):
    """torch tensors (bfloat16 too) and MindSpore tensors are taken as numpy would be."""
    import mindspore as ms

    new = perturbed(checkpoint_tensors(DEMO_MODEL_DIR))
    names = sorted(new)
    given = {k: torch.from_numpy(new[k]) for k in names[::3]}
    given.update({k: ms.Tensor(new[k]) for k in names[1::3]})
    given.update({k: torch.from_numpy(new[k]).bfloat16() for k in names[2::3]})
    expect = {k: (host(v.float()) if isinstance(v, torch.Tensor) else new[k]) for k, v in given.items()}
    model = load_model(DEMO_MODEL_DIR, backend=backend, dtype="float64", kernels="plain")
    update_weights(model, given)
    reference = load_model(save_like(DEMO_MODEL_DIR, expect, tmp_path / "new"), backend=backend, dtype="float64")
    np.testing.assert_array_equal(logits(model), logits(reference))


def _bad_cases(tensors):
    name = "model.layers.0.mlp.down_proj.weight"
    good = tensors[name]
    nan = good.copy()
    nan[0, 0] = np.nan
    inf = good.copy()
    inf[1, 2] = np.inf
    return [
        ("model.layers.99.mlp.down_proj.weight", good, ValueError, "model.layers.99"),
        (name, good[:, :-1], ValueError, "shape"),
        (name, good.astype(np.int32), ValueError, "dtype"),
        (name, good > 0, ValueError, "dtype"),
        (name, nan, ValueError, "NaN"),
        (name, inf, ValueError, "inf"),
        (name, good.tolist(), TypeError, name),
        (name, None, TypeError, name),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_updates_are_refused_and_change_nothing(backend, one_torch_thread):
    tensors = checkpoint_tensors(DEMO_MODEL_DIR)
    new = perturbed(tensors)
    model = load_model(DEMO_MODEL_DIR, backend=backend, kernels="plain")
    before = logits(model)
    for bad_name, bad, error, words in _bad_cases(tensors):
        items = [(k, v) for k, v in new.items() if k != bad_name] + [(bad_name, bad)]  # the bad one last
        with pytest.raises(error, match=words.replace(".", r"\.").replace("[", r"\[")) as raised:
            update_weights(model, items)
        assert bad_name in str(raised.value)
        np.testing.assert_array_equal(logits(model), before)
    with pytest.raises(TypeError, match="pair"):
        update_weights(model, [new["model.norm.weight"]])
    with pytest.raises(ValueError, match="twice"):
        update_weights(model, [("model.norm.weight", new["model.norm.weight"])] * 2)
    np.testing.assert_array_equal(logits(model), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_partial_group_after_an_update_is_refused(backend, one_torch_thread):
    """The model keeps no second copy of its weights: a fused group changed earlier must come whole."""
    new = perturbed(checkpoint_tensors(DEMO_MODEL_DIR))
    model = load_model(DEMO_MODEL_DIR, backend=backend, kernels="plain")
    update_weights(model, new)
    before = logits(model)
    q = "model.layers.3.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="send .* again"):
        update_weights(model, [(q, new[q] * 2)])
    np.testing.assert_array_equal(logits(model), before)


def test_not_a_loaded_model():
    with pytest.raises(ValueError, match="load_model"):
        update_weights(torch.nn.Linear(2, 2), {})


# -------------------------------------------------------------------------------------- engine


def _greedy(max_tokens=10, ignore_eos=False):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)


def reference(model, new=10):
    """generate()'s new greedy tokens for PROMPT, up to the EOS that ends them (as the engine's)."""
    row = tokens(model, new)[0, len(PROMPT[0]) :]
    ended = np.flatnonzero(row == model.generation_defaults["eos_token_id"])
    return row[: ended[0] + 1].tolist() if ended.size else row.tolist()


@pytest.mark.parametrize("backend", SLOW_ON_MINDSPORE)
def test_engine_update_between_and_during_requests(backend, tmp_path, one_torch_thread):
    new = perturbed(checkpoint_tensors(DEMO_MODEL_DIR))
    model = load_model(DEMO_MODEL_DIR, backend=backend)
    updated = load_model(save_like(DEMO_MODEL_DIR, new, tmp_path / "new"), backend=backend)
    before, after = reference(model), reference(updated)
    assert before != after
    with Engine(model, max_batch_size=2) as engine:
        first = engine.submit(PROMPT[0], _greedy()).result(timeout=120)
        assert first.weight_version is None and first.outputs[0].token_ids == before
        assert engine.update_weights(new.items(), version=7) == len(new)
        assert engine.weight_version == 7
        second = engine.submit(PROMPT[0], _greedy()).result(timeout=120)
        assert second.weight_version == 7 and second.outputs[0].token_ids == after
        # during a request: it continues on the new weights; its output carries the new version
        stream = engine.submit(PROMPT[0], _greedy(200, ignore_eos=True))
        next(iter(stream))
        with pytest.raises(ValueError, match="shape"):  # refused in the caller, the engine untouched
            engine.update_weights([("model.norm.weight", np.zeros(3, np.float32))], version=8)
        engine.update_weights(perturbed(checkpoint_tensors(DEMO_MODEL_DIR), seed=3), version="v9")
        running = stream.result(timeout=300)
        assert running.weight_version == "v9" and len(running.outputs[0].token_ids) == 200
        engine.update_weights(new, version=10)
        third = engine.submit(PROMPT[0], _greedy()).result(timeout=120)
        assert third.weight_version == 10 and third.outputs[0].token_ids == after


@pytest.mark.parametrize("backend", SLOW_ON_MINDSPORE)
def test_engine_stepped_by_the_caller(backend, tmp_path, one_torch_thread):
    new = perturbed(checkpoint_tensors(DEMO_MODEL_DIR))
    model = load_model(DEMO_MODEL_DIR, backend=backend)
    after = reference(load_model(save_like(DEMO_MODEL_DIR, new, tmp_path / "new"), backend=backend))
    engine = Engine(model).start(background=False)
    stream = engine.submit(PROMPT[0], _greedy(30, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.update_weights(new, version=1) == len(new)  # settled inline, between two steps
    while engine.step():
        pass
    assert stream.result(timeout=10).weight_version == 1
    stream = engine.submit(PROMPT[0], _greedy())
    while engine.step():
        pass
    out = stream.result(timeout=10)
    assert out.weight_version == 1 and out.outputs[0].token_ids == after
    engine.shutdown()


def test_engine_update_from_many_threads_is_serialised(tmp_path, one_torch_thread):
    """Concurrent updates each land whole, at a step boundary: the last one's weights are the model's."""
    tensors = checkpoint_tensors(DEMO_MODEL_DIR)
    model = load_model(DEMO_MODEL_DIR)
    updates = [perturbed(tensors, seed=s) for s in range(3)]
    with Engine(model) as engine:
        threads = [threading.Thread(target=engine.update_weights, args=(u, i)) for i, u in enumerate(updates)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        last = updates[engine.weight_version]
    np.testing.assert_array_equal(logits(model), logits(load_model(save_like(DEMO_MODEL_DIR, last, tmp_path / "x"))))


# ------------------------------------------------------------------------------- tensor parallel

_TP_SCRIPT = """
import sys
import numpy as np
import torch
from safetensors.numpy import load_file
from hyper_gen import load_model, update_weights

for spec in sys.argv[1:]:
    label, path, new_path = spec.split("=")
    model = load_model(path, dtype="float64", tp=2, kernels="plain")
    rank = torch.distributed.get_rank()
    count = update_weights(model, load_file(new_path + "/model.safetensors"))  # every rank: the full tensors
    fresh = load_model(new_path, dtype="float64", tp=2, kernels="plain")
    ids = torch.tensor([[3, 17, 42, 8, 23, 5]])
    same = torch.equal(model(ids)["logits"], fresh(ids)["logits"])
    print(f"rank {rank}: {label} {count} {'same' if same else 'differ'}", flush=True)
"""


@pytest.mark.distributed
def test_tp2_ranks_slice_the_full_tensors(tmp_path):
    from launch import torchrun
    from qwen_checkpoints import make_checkpoint

    specs = []
    for label, kind, kwargs in [
        ("dense", "dense", {}),
        ("moe_fused_tied", "moe", {"fused_experts": True, "tie_word_embeddings": True}),
    ]:
        path = make_checkpoint(tmp_path, kind, **kwargs)
        new = save_like(path, perturbed(checkpoint_tensors(path)), tmp_path / f"{label}-new")
        specs.append(f"{label}={path}={new}")
    script = tmp_path / "tp_update.py"
    script.write_text(_TP_SCRIPT)
    result = torchrun([str(script)] + specs, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "differ" not in result.stdout, result.stdout[-3000:]
    for rank in (0, 1):
        for spec in specs:  # (the ranks' lines may interleave)
            assert re.search(rf"rank {rank}: {spec.split('=')[0]} [1-9]\d* same", result.stdout), result.stdout[-3000:]
