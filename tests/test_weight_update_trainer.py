"""``update_weights`` fed an HF trainer's own tensors (issue 48): a transformers 5
``Qwen3_5MoeForCausalLM`` keeps its experts fused at run time (``mlp.experts.gate_up_proj`` /
``down_proj``, 3-D) while ``save_pretrained`` names each expert. Either layout updates a model
loaded from either checkpoint layout, on torch and MindSpore, through ``update_weights`` and the
engine; afterwards the model generates what the trainer's HF ``generate`` does. A bad tensor among
them leaves the model unchanged.
"""

import os

import numpy as np
import pytest
import torch
from backend_harness import SLOW_ON_MINDSPORE
from qwen_checkpoints import load_hf, make_checkpoint
from safetensors.torch import load_file

from hyper_gen import generate, load_model, update_weights
from hyper_gen.engine import Engine, SamplingParams

BACKENDS = ["torch", "mindspore"]
PROMPT = [[3, 17, 42, 8, 23, 5, 61, 30]]
NEW = 8


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.detach().cpu().numpy()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    return {
        "per_expert": make_checkpoint(root, kind="moe"),
        "fused": make_checkpoint(root, kind="moe", fused_experts=True),
    }


def trained(path, seed=3):
    """The HF model of ``path`` after a "training step": every parameter moved."""
    trainer = load_hf(path, "float64")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return trainer


def hf_tokens(trainer):
    with torch.no_grad():
        out = trainer.generate(torch.tensor(PROMPT), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return out[:, len(PROMPT[0]) :].numpy()


def our_tokens(model):
    out = generate(model, np.array(PROMPT), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return host(out)[:, len(PROMPT[0]) :]


def logits(model):
    if hasattr(model, "construct"):
        import mindspore as ms

        return model(ms.Tensor(np.array(PROMPT, np.int64)))["logits"].asnumpy()
    return model(torch.tensor(PROMPT))["logits"].detach().numpy()


def hf_logits(trainer):
    with torch.no_grad():
        return trainer(torch.tensor(PROMPT)).logits.numpy()


def assert_is_the_trainer(model, trainer):
    """HF's float64 model runs its Gated DeltaNet in float32 in places: logits within 1e-4 (a
    missed tensor moves them by far more: see ``test_the_update_is_needed``), the same tokens."""
    np.testing.assert_allclose(logits(model), hf_logits(trainer), rtol=0, atol=1e-4)
    np.testing.assert_array_equal(our_tokens(model), hf_tokens(trainer))


def per_expert_names(trainer, folder):
    """The trainer's tensors as ``save_pretrained`` names them (one tensor per expert)."""
    trainer.save_pretrained(folder)
    return load_file(os.path.join(folder, "model.safetensors"))


def test_the_update_is_needed(paths, one_torch_thread):
    """The comparison below can tell: the checkpoint's model is far from the trained one, and so is
    a model whose experts alone missed the update."""
    trainer = trained(paths["per_expert"])
    model = load_model(paths["per_expert"], backend="torch", dtype="float64", kernels="plain")
    assert np.abs(logits(model) - hf_logits(trainer)).max() > 1e-2
    update_weights(model, {k: v for k, v in trainer.state_dict().items() if ".experts." not in k})
    assert np.abs(logits(model) - hf_logits(trainer)).max() > 1e-2


@pytest.mark.parametrize("backend", SLOW_ON_MINDSPORE)
@pytest.mark.parametrize("loaded_from", ["per_expert", "fused"])
def test_a_trainers_state_dict_updates_either_checkpoint_layout(backend, loaded_from, paths, one_torch_thread):
    trainer = trained(paths["per_expert"])
    state = trainer.state_dict()
    assert (
        "model.layers.0.mlp.experts.gate_up_proj" in state and state["model.layers.0.mlp.experts.down_proj"].ndim == 3
    )
    model = load_model(paths[loaded_from], backend=backend, dtype="float64", kernels="plain")
    assert update_weights(model, state.items()) == len(state)
    assert_is_the_trainer(model, trainer)


@pytest.mark.parametrize("backend", SLOW_ON_MINDSPORE)
def test_per_expert_names_update_a_fused_model(backend, paths, tmp_path, one_torch_thread):
    """The reverse: a model loaded from a fused checkpoint takes ``save_pretrained``'s names, all of
    them or one expert's (the other experts keep their values)."""
    model = load_model(paths["fused"], backend=backend, dtype="float64", kernels="plain")
    trainer = trained(paths["per_expert"])  # (same weights as the fused checkpoint; saves per expert)
    saved = per_expert_names(trainer, tmp_path / "saved")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved
    assert update_weights(model, saved.items()) == len(saved)
    assert_is_the_trainer(model, trainer)
    # one expert of one layer, on a fresh model: the fused tensors are stacked with the checkpoint's other experts
    fresh = load_model(paths["fused"], backend=backend, dtype="float64", kernels="plain")
    reference = load_hf(paths["fused"], "float64")
    one = {k: v for k, v in saved.items() if k.startswith("model.layers.2.mlp.experts.4.")}
    assert len(one) == 3
    update_weights(fresh, one)
    with torch.no_grad():
        experts = reference.model.layers[2].mlp.experts
        inter = experts.down_proj.shape[2]
        experts.gate_up_proj[4, :inter] = one["model.layers.2.mlp.experts.4.gate_proj.weight"]
        experts.gate_up_proj[4, inter:] = one["model.layers.2.mlp.experts.4.up_proj.weight"]
        experts.down_proj[4] = one["model.layers.2.mlp.experts.4.down_proj.weight"]
    assert_is_the_trainer(fresh, reference)
    # that fused tensor is now changed and the model keeps no copy: a partial update must send it all
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj.*send all"):
        update_weights(
            fresh, {"model.layers.2.mlp.experts.0.up_proj.weight": one["model.layers.2.mlp.experts.4.up_proj.weight"]}
        )
    assert_is_the_trainer(fresh, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loaded_from", ["per_expert", "fused"])
def test_a_bad_tensor_among_the_trainers_leaves_the_model_unchanged(
    backend, loaded_from, paths, tmp_path, one_torch_thread
):
    model = load_model(paths[loaded_from], backend=backend, dtype="float64", kernels="plain")
    before = logits(model)
    trainer = trained(paths["per_expert"])
    state = dict(trainer.state_dict())
    saved = per_expert_names(trainer, tmp_path / "saved")
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    cases = [
        ({**state, fused: state[fused][:, :-1]}, "shape"),  # a fused tensor misshaped
        (
            {
                **state,
                "model.layers.1.mlp.experts.6.up_proj.weight": saved["model.layers.1.mlp.experts.5.up_proj.weight"],
            },
            "not a weight",
        ),
        (
            {
                **state,
                "model.layers.1.mlp.experts.2.up_proj.weight": saved["model.layers.1.mlp.experts.2.up_proj.weight"],
            },
            "twice",
        ),
        ({**saved, "model.layers.3.mlp.experts.down_proj": state["model.layers.3.mlp.experts.down_proj"]}, "twice"),
        (
            {
                **saved,
                "model.layers.0.mlp.experts.1.down_proj.weight": saved["model.layers.0.mlp.experts.1.up_proj.weight"],
            },
            "shape",
        ),
    ]
    for weights, words in cases:
        with pytest.raises(ValueError, match=words):
            update_weights(model, weights.items())
        np.testing.assert_array_equal(logits(model), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engine_takes_a_trainers_state_dict(backend, paths, one_torch_thread):
    model = load_model(paths["per_expert"], backend=backend, dtype="float64", kernels="plain")
    trainer = trained(paths["per_expert"])
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with Engine(model, max_batch_size=2) as engine:
        assert engine.update_weights(trainer.state_dict().items(), version="step-1") == len(trainer.state_dict())
        out = engine.submit(PROMPT[0], params).result(timeout=120)
    assert out.weight_version == "step-1"
    assert list(out.outputs[0].token_ids) == hf_tokens(trainer)[0].tolist()


def test_a_server_checks_announced_tensors_in_either_layout(paths):
    """``model_shapes`` (what POST /update_weights_from_distributed and _from_tensor check names
    against before receiving) knows both layouts, with their shapes."""
    from hyper_gen.models.weight_update import announced_problem, model_shapes

    for loaded_from in ("per_expert", "fused"):
        shapes = model_shapes(load_model(paths[loaded_from], backend="torch", kernels="plain"))
        assert announced_problem(shapes, "model.layers.0.mlp.experts.gate_up_proj", (6, 48, 32)) == (None, None)
        assert announced_problem(shapes, "model.layers.0.mlp.experts.down_proj", (6, 32, 24)) == (None, None)
        assert announced_problem(shapes, "model.layers.3.mlp.experts.5.down_proj.weight", (32, 24)) == (None, None)
        assert announced_problem(shapes, "model.layers.0.mlp.experts.gate_up_proj", (6, 24, 32))[0] == "shapes"
        assert announced_problem(shapes, "model.layers.0.mlp.experts.6.up_proj.weight", (24, 32))[0] == "names"
