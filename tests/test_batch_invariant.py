"""Batch-invariant mode (``load_model(..., batch_invariant=True)``), torch native Qwen3.5 dense and MoE.

A prompt's ``generate(output_logprobs=True)`` raw logprobs must be the same bits alone and inside
batches of other random prompts (other lengths, left padding), equal to ``score()`` of the finished
sequences, to the model's own full-sequence forward under autograd, and to a forward that computes
the positions in chunks or one at a time through a cache; the model trains: its gradients match HF
transformers' on the same weights in float64. (MindSpore: not yet, a ValueError.)
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from model_harness import HFReference, hf_in_float64
from qwen_checkpoints import make_checkpoint

from hyper_gen import generate, score
from hyper_gen.backends.torch.ops import TorchOps
from hyper_gen.cache import make_cache
from hyper_gen.masks import full_sequence_mask
from hyper_gen.models.checkpoint import Checkpoint
from hyper_gen.models.loading import load_model
from hyper_gen.models.qwen3_5 import describe
from hyper_gen.models.weight_update import UpdateSource
from hyper_gen.positions import cumsum_positions

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 10
CASES = [("dense", "float32"), ("dense", "bfloat16"), ("moe", "float32"), ("moe", "bfloat16"), ("wide", "float32")]
# head dims of 64 (torch's own sum over such an axis gave a row other bits among 96 rows than among 8)
WIDE = dict(hidden_size=128, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, intermediate_size=256)


def _checkpoint(checkpoint_dir, kind):
    if kind == "wide":
        return make_checkpoint(checkpoint_dir, "dense", text_overrides=WIDE)
    return make_checkpoint(checkpoint_dir, kind, fused_experts=kind == "moe")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batch_invariant")


@pytest.fixture(scope="module")
def models(checkpoint_dir):
    @functools.lru_cache(maxsize=None)
    def get(kind, dtype, invariant=True):
        return load_model(
            _checkpoint(checkpoint_dir, kind), backend="torch", dtype=dtype, batch_invariant=invariant, kernels="plain"
        )

    return get


def _random_prompts(rng, count):
    return [rng.integers(8, 90, size=int(rng.integers(1, 40))).tolist() for _ in range(count)]


def _rollout(model, prompts, **kwargs):
    """generate() over left-padded ``prompts``: the output and each row's raw logprobs (its own tokens)."""
    width = max(map(len, prompts))
    ids = np.array([[0] * (width - len(p)) + p for p in prompts])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = generate(
        model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        return_dict_in_generate=True, output_logprobs=True, **kwargs,
    )  # fmt: skip
    rows = [out.raw_logprobs[i, : int(out.generated_lengths[i])] for i in range(len(prompts))]
    return out, rows


def _finished(prompt, out, row=0):
    """The row's [prompt | generated] tokens (``sequences`` rows are [prompt | generated | pad])."""
    total = len(prompt) + int(out.generated_lengths[row])
    tokens = out.sequences[row, :total].tolist()
    assert tokens[: len(prompt)] == prompt
    return tokens


def _picked(logits, tokens):
    """float32 log-softmax of (S, V) logits at the (S,) tokens (generate's raw logprobs' arithmetic)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("kind,dtype", CASES)
def test_a_rows_logprobs_alone_equal_inside_batches(models, kind, dtype):
    model = models(kind, dtype)
    rng = np.random.default_rng(1)
    prompt = rng.integers(8, 90, size=9).tolist()
    _, (alone,) = _rollout(model, [prompt])
    assert alone.shape[0] > 0
    for size in (2, 5, 16):
        others = _random_prompts(rng, size - 1)
        at = int(rng.integers(0, size))
        _, rows = _rollout(model, others[:at] + [prompt] + others[at:])
        assert torch.equal(rows[at], alone), (size, (rows[at] - alone).abs().max())


def test_default_mode_is_not_batch_invariant(models):
    """What the mode fixes is real here: the default model's row differs inside a batch."""
    model = models("dense", "float32", invariant=False)
    rng = np.random.default_rng(1)
    prompt = rng.integers(8, 90, size=9).tolist()
    _, (alone,) = _rollout(model, [prompt])
    _, rows = _rollout(model, [prompt] + _random_prompts(rng, 4))
    assert not torch.equal(rows[0], alone)


@pytest.mark.parametrize("kind,dtype", CASES)
def test_score_and_the_trainers_forward_give_the_rollouts_logprobs(models, kind, dtype):
    """score() of the finished (right-padded) batch, and the model's own full-sequence forward under
    autograd (grad mode, parameters requiring grad), give every row's raw logprobs bit for bit."""
    model = models(kind, dtype)
    prompts = _random_prompts(np.random.default_rng(2), 6)
    out, rows = _rollout(model, prompts)
    total = np.asarray(out.prompt_lengths) + np.asarray(out.generated_lengths)
    mask = np.arange(out.sequences.shape[1])[None, :] < total[:, None]
    scored = score(model, out.sequences, mask, out.prompt_lengths)
    # the trainer's batch: each finished row right-padded, one forward with autograd on
    sequences = [_finished(p, out, i) for i, p in enumerate(prompts)]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    real = np.array([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    assert all(p.requires_grad for p in model.parameters())
    logits = model(
        ids,
        position_ids=torch.from_numpy(cumsum_positions(real)),
        attention_mask=torch.from_numpy(full_sequence_mask(real, dtype if dtype != "bfloat16" else "float32")).to(
            model.dtype
        ),
    )["logits"]
    assert logits.requires_grad
    for i, (p, row) in enumerate(zip(prompts, rows)):
        start, n = len(p), row.shape[0]
        at = int(out.prompt_lengths[i])
        assert torch.equal(scored[i, at : at + n], row), i
        trained = _picked(logits[i, start - 1 : start - 1 + n], ids[i, start : start + n]).detach()
        assert torch.equal(trained, row), (i, (trained - row).abs().max())


@pytest.mark.parametrize("kind,dtype", CASES)
def test_chunked_and_token_by_token_forwards_give_the_rollouts_logprobs(models, kind, dtype):
    """The positions of one finished row through a cache in chunks of 3 and of 7, and one at a time."""
    model = models(kind, dtype)
    prompt = np.random.default_rng(3).integers(8, 90, size=11).tolist()
    out, (row,) = _rollout(model, [prompt])
    tokens = _finished(prompt, out)
    wanted = torch.tensor(tokens[len(prompt) :])
    for chunk in (1, 3, 7):
        cache = make_cache("dynamic", TorchOps("cpu"), 1, len(tokens))
        logits = []
        with torch.no_grad():
            for start in range(0, len(tokens) - 1, chunk):
                piece = torch.tensor([tokens[start : min(start + chunk, len(tokens) - 1)]])
                logits.append(model(piece, past_key_values=cache, logits_to_keep=0)["logits"][0])
                cache.advance(piece.shape[1])
        logits = torch.cat(logits)
        got = _picked(logits[len(prompt) - 1 :], wanted)
        assert torch.equal(got, row), (chunk, (got - row).abs().max())


def _hf_gradients_in_native_layout(model, path, hf):
    """HF's parameter gradients laid out as the native model's parameters (through the port's own
    checkpoint conversion, read from the gradients as if they were the weights)."""
    from hyper_gen.backends.torch.models import qwen3_5 as port

    grads = {name: p.grad.numpy() for name, p in hf.named_parameters() if p.grad is not None}
    source = UpdateSource(Checkpoint(path), grads, set())
    weights = port._Weights(source, torch.float64, "cpu", SimpleNamespace(layout=lambda w: w), trainable=True)
    return port._state(weights, describe(source, model.config, model.tp_plan))


@pytest.mark.parametrize("kind", ["dense", "moe", "wide"])
def test_gradients_equal_hfs_in_float64(models, checkpoint_dir, kind):
    model = models(kind, "float64")
    path = _checkpoint(checkpoint_dir, kind)
    hf = HFReference(path, "float64", exact=True).model  # HF computing in float64 throughout
    ids = torch.from_numpy(np.random.default_rng(4).integers(8, 90, size=(2, 13)))
    probe = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 13, model.vocab_size)))
    model.zero_grad(set_to_none=True)
    (model(ids)["logits"] * probe).sum().backward()
    with hf_in_float64():
        (hf(input_ids=ids).logits * probe).sum().backward()
    wanted = _hf_gradients_in_native_layout(model, path, hf)
    params = dict(model.named_parameters())
    assert set(params) <= set(wanted) | {"lm_head"}, set(params) - set(wanted)
    for name, p in params.items():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, wanted[name], rtol=1e-7, atol=1e-9, msg=name)


def test_bad_values_and_unsupported_setups_are_refused(checkpoint_dir):
    path = make_checkpoint(checkpoint_dir, "dense")
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        load_model(path, backend="torch", batch_invariant="yes")
    with pytest.raises(ValueError, match="one device for now"):
        load_model(path, backend="torch", tp=2, batch_invariant=True)


@pytest.mark.slow  # importing MindSpore: ~10 s
def test_mindspore_refuses_batch_invariant_before_reading_weights(checkpoint_dir):
    path = make_checkpoint(checkpoint_dir, "dense")
    with pytest.raises(ValueError, match="batch_invariant=True is not supported by backend='mindspore'"):
        load_model(path, backend="mindspore", batch_invariant=True)


def test_the_row_quanta_are_the_models_kernel_plan(models):
    plan = models("moe", "float32").kernel_plan
    assert plan.choices and all(k.startswith("invariant ") for k in plan.choices)
    assert all(v == "sum" or v.startswith("plain+rows:") for v in plan.choices.values())  # kernels="plain"


def test_row_quanta_are_recorded_in_a_plan_of_their_own_and_pinnable(checkpoint_dir, tmp_path, monkeypatch):
    """kernels="auto": the quanta go to the host's "torch-invariant" plan file, never into the default
    plan (which older code reads and would refuse); a saved plan pins them; a default plan is refused."""
    monkeypatch.setenv("HYPER_GEN_CACHE_DIR", str(tmp_path / "cache"))
    path = make_checkpoint(checkpoint_dir, "dense")
    invariant = load_model(path, backend="torch", batch_invariant=True, kernels="auto")
    assert invariant.kernel_plan.mode == "auto" and invariant.kernel_plan.choices
    assert invariant.kernel_plan.backend == "torch-invariant"
    default = load_model(path, backend="torch", kernels="auto")
    assert not any(key.startswith("invariant ") for key in default.kernel_plan.choices)
    pinned = tmp_path / "plan.json"
    invariant.kernel_plan.save(pinned)
    again = load_model(path, backend="torch", batch_invariant=True, kernels=str(pinned))
    assert again.kernel_plan.choices == invariant.kernel_plan.choices
    default.kernel_plan.save(tmp_path / "default.json")
    with pytest.raises(ValueError, match="is for backend 'torch', not 'torch-invariant'"):
        load_model(path, backend="torch", batch_invariant=True, kernels=str(tmp_path / "default.json"))


@pytest.mark.parametrize("kernel", ["plain+rows:4", "blocked:256+rows:4"])
def test_a_pinned_kernel_projects_each_row_alike_among_any_rows(kernel):
    from hyper_gen.backends.torch.invariant_products import InvariantKernels, plan_key
    from hyper_gen.kernel_plan import KernelPlan

    w_t = torch.randn(1024, 512, generator=torch.Generator().manual_seed(0)).t()  # (in, out) of (out, in) memory
    kernels = InvariantKernels(KernelPlan("torch-invariant", "", "pinned", {plan_key(w_t, False): kernel}))
    w = kernels.layout(w_t)
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([kernels.project(x[i : i + 1], w) for i in range(37)])
    for rows in (2, 5, 11, 37):
        assert torch.equal(kernels.project(x[:rows], w), alone[:rows]), rows
    assert kernels.used_plan().choices == {plan_key(w_t, False): kernel}


def test_a_pinned_plan_with_a_kernel_this_mode_does_not_run_is_refused():
    from hyper_gen.backends.torch.invariant_products import InvariantKernels
    from hyper_gen.kernel_plan import KernelPlan

    with pytest.raises(ValueError, match="is not a torch-invariant kernel"):
        InvariantKernels(KernelPlan("torch-invariant", "", "pinned", {"invariant 8x8 float32 cpu matrix": "onednn"}))


def test_a_pinned_block_width_that_does_not_divide_the_output_is_refused():
    from hyper_gen.backends.torch.invariant_products import InvariantKernels, plan_key
    from hyper_gen.kernel_plan import KernelPlan

    w_t = torch.zeros(1000, 512).t()
    kernels = InvariantKernels(
        KernelPlan("torch-invariant", "", "pinned", {plan_key(w_t, False): "blocked:256+rows:4"})
    )
    with pytest.raises(ValueError, match="column blocks need a matrix whose output size the width divides"):
        kernels.layout(w_t)


def test_update_weights_writes_the_invariant_models_own_parameters(checkpoint_dir):
    """update_weights (an RL trainer on another process) reaches the mode's parameters (norm weights,
    A_log included): the updated model's logits are a fresh load's of the new weights, bit for bit."""
    from safetensors.torch import load_file

    from hyper_gen import update_weights

    old, new = make_checkpoint(checkpoint_dir, "dense"), make_checkpoint(checkpoint_dir, "dense", seed=1)
    model = load_model(old, backend="torch", batch_invariant=True, kernels="plain")
    update_weights(model, load_file(f"{new}/model.safetensors"))
    fresh = load_model(new, backend="torch", batch_invariant=True, kernels="plain")
    ids = torch.from_numpy(np.random.default_rng(6).integers(8, 90, size=(3, 9)))
    with torch.no_grad():
        assert torch.equal(model(ids)["logits"], fresh(ids)["logits"])
