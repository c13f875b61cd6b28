"""Routed experts for routing replay (R3): ``return_routed_experts=True`` returns the expert ids every
MoE layer's router chose, as vLLM / SGLang return them: a position's routing is the one of the forward
that fed its token (docs in hyper_gen/outputs.py, ``GenerateOutput``).

Checked against HF transformers' Qwen3.5 MoE recomputing each returned sequence in one forward, with
a hook on every router recording its top-k ids: greedy and seeded sampling, a left-padded batch,
num_return_sequences=2, with and without a cache, on the torch and MindSpore ports; the engine's
per-choice routing equals generate's; bad input names the field.
"""

import functools

import mindspore  # noqa: F401  (imported first: these tests fail, never skip, without MindSpore)
import numpy as np
import pytest
import torch
from qwen_checkpoints import load_hf, make_checkpoint

from hyper_gen import GenerationConfig, generate, load_model

NEW = 6
PROMPTS = [[11, 40, 23, 67, 12, 90, 31, 44, 8], [50, 9, 77], [63, 21, 35, 88, 14, 19]]


@pytest.fixture(scope="module")
def root(tmp_path_factory, one_torch_thread):  # tiny matmuls: a second OpenMP thread only waits
    return tmp_path_factory.mktemp("routed_experts")


@functools.lru_cache(maxsize=None)
def _model(path, backend, dtype="float64"):
    model = load_model(path, backend=backend.split("-")[0], dtype=dtype)
    if backend == "mindspore-compiled":  # its one-token steps jitted from the first (the MoE routes on the host)
        model.decode_compile_after = 1
    return model


@pytest.fixture(scope="module")
def moe(root):
    return make_checkpoint(root, "moe", "float64")


@pytest.fixture(scope="module")
def hf(moe):
    return HFRoutes(moe)


class HFRoutes:
    """HF's router picks for a whole sequence: (S, moe_layers, top_k), one forward, no padding."""

    def __init__(self, path):
        self.model = load_hf(path, "float64")
        self.routes = []
        self.gates = [m for n, m in self.model.named_modules() if n.endswith("mlp.gate")]
        for gate in self.gates:
            gate.register_forward_hook(lambda module, args, output: self.routes.append(output[2]))

    def __call__(self, tokens) -> np.ndarray:
        self.routes = []
        with torch.no_grad():
            self.model(torch.tensor([list(tokens)]), use_cache=False)
        return torch.stack(self.routes, 1).numpy()


def padded(prompts):
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.numpy()


def check_against_hf(out, hf, top_k):
    sequences = host(out.sequences)
    routed, prompt_routed = out.routed_experts, out.prompt_routed_experts
    batch, steps = routed.shape[:2]
    assert routed.shape == (batch, steps, len(hf.gates), top_k) and routed.dtype == np.int64
    assert steps == host(out.raw_logprobs).shape[1]
    assert prompt_routed.shape[:2] == (batch, max(out.prompt_lengths))
    for row in range(batch):
        p, g = out.prompt_lengths[row], out.generated_lengths[row]
        expected = hf(sequences[row, : p + g])  # every position's routing, as the forward that fed it
        np.testing.assert_array_equal(out.sequence_routed_experts(row), expected[:-1])  # the last is never fed
        np.testing.assert_array_equal(routed[row, :g], expected[p - 1 : p + g - 1])  # step t: position p + t - 1
        np.testing.assert_array_equal(prompt_routed[row, :p], expected[:p])
        assert (routed[row, g:] == -1).all() and (prompt_routed[row, p:] == -1).all()


@pytest.mark.parametrize("backend", ["torch", "mindspore", pytest.param("mindspore-compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=False),
        dict(do_sample=True, seed=3, temperature=1.5, top_k=0, num_return_sequences=2),
        dict(do_sample=False, use_cache=False, cache_implementation="dynamic"),
    ],
    ids=["greedy", "seeded-n2", "no-cache"],
)
def test_routed_experts_equal_hf_router_picks(moe, hf, backend, options):
    model = _model(moe, backend)
    assert model.moe_layers == len(hf.gates) == 4
    ids, mask = padded(PROMPTS)
    cfg = GenerationConfig(
        max_new_tokens=NEW,
        eos_token_id=[5, 7, 12, 30, 41, 60],  # some rows end early: -1 past their end
        return_dict_in_generate=True,
        output_logprobs=True,
        return_routed_experts=True,
        **options,
    )
    out = generate(model, ids, cfg, attention_mask=mask)
    check_against_hf(out, hf, top_k=2)
    assert out.routed_experts.shape[0] == len(PROMPTS) * cfg.num_return_sequences


def test_no_routing_kept_unless_asked(moe):
    model = _model(moe, "torch")
    out = generate(model, [PROMPTS[0]], max_new_tokens=2, return_dict_in_generate=True)
    assert out.routed_experts is None and "routed_experts" not in out.keys()
    assert all(layer.mlp.routes is None for layer in model.layers)


def test_bad_input_names_the_field(root, moe):
    model = _model(moe, "torch")
    with pytest.raises(TypeError, match="return_routed_experts"):
        GenerationConfig(return_routed_experts="yes", return_dict_in_generate=True)
    with pytest.raises(ValueError, match="return_routed_experts.*return_dict_in_generate"):
        generate(model, [PROMPTS[0]], max_new_tokens=2, return_routed_experts=True)
    dense = _model(make_checkpoint(root, "dense", "float32"), "torch", "float32")
    with pytest.raises(ValueError, match="return_routed_experts.*no MoE layers"):
        generate(dense, [PROMPTS[0]], max_new_tokens=2, return_dict_in_generate=True, return_routed_experts=True)


@pytest.mark.parametrize("backend", ["torch", pytest.param("mindspore", marks=pytest.mark.slow)])  # 10 s: whole suite
def test_engine_routed_experts_equal_generate(moe, backend):
    from hyper_gen.engine import Engine, SamplingParams

    model = _model(moe, backend)
    greedy = SamplingParams(max_tokens=NEW, temperature=0, return_routed_experts=True)
    seeded = SamplingParams(max_tokens=NEW, n=2, seed=3, temperature=1.5, return_routed_experts=True)
    requests = [(p, greedy) for p in PROMPTS] + [(PROMPTS[1], seeded), (PROMPTS[0], SamplingParams(max_tokens=2))]
    with Engine(model, max_batch_size=3) as engine:  # rows join and leave a running batch
        outs = engine.run_batch(requests)
    assert outs[-1].outputs[0].routed_experts is None
    for (prompt, params), out in zip(requests[:-1], outs):
        options = dict(do_sample=False) if params.greedy else dict(do_sample=True, seed=3, temperature=1.5, top_k=0)
        ref = generate(
            model, [prompt], max_new_tokens=NEW, num_return_sequences=params.n, return_dict_in_generate=True,
            return_routed_experts=True, **options,
        )  # fmt: skip
        for choice in out.outputs:
            g = ref.generated_lengths[choice.index]
            assert choice.token_ids == host(ref.sequences)[choice.index, len(prompt) : len(prompt) + g].tolist()
            np.testing.assert_array_equal(choice.routed_experts, ref.routed_experts[choice.index, :g])


def test_engine_bad_input_names_the_field(root):
    from hyper_gen.engine import Engine, SamplingParams

    with pytest.raises(TypeError, match="return_routed_experts"):
        SamplingParams(return_routed_experts="yes")
    dense = _model(make_checkpoint(root, "dense", "float32"), "torch", "float32")
    with Engine(dense) as engine:
        with pytest.raises(ValueError, match="return_routed_experts.*no MoE layers"):
            engine.submit(PROMPTS[0], SamplingParams(return_routed_experts=True))


TP_SCRIPT = """
import ast
import sys

import numpy as np
import torch

from hyper_gen import generate, load_model

torch.set_num_threads(1)
path, out, options = sys.argv[1], sys.argv[2], ast.literal_eval(sys.argv[5])
ids, mask = np.load(sys.argv[3]), np.load(sys.argv[4])
model = load_model(path, backend="torch", dtype="float64", tp=2)
result = generate(model, ids, attention_mask=mask, return_dict_in_generate=True, return_routed_experts=True, **options)
rank = torch.distributed.get_rank()
np.save(f"{out}/rank{rank}.npy", result.routed_experts)
np.save(f"{out}/prompt{rank}.npy", result.prompt_routed_experts)
"""


@pytest.mark.distributed
def test_tp2_routes_as_tp1_on_every_rank(moe, tmp_path):
    """The router is replicated under tensor parallelism: every rank returns the tp=1 ids."""
    from launch import torchrun

    ids, mask = padded(PROMPTS)
    options = dict(max_new_tokens=NEW, do_sample=True, seed=3, temperature=1.5, top_k=0, num_return_sequences=2)
    (tmp_path / "tp.py").write_text(TP_SCRIPT)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)
    arrays = [str(tmp_path / "ids.npy"), str(tmp_path / "mask.npy")]
    result = torchrun([str(tmp_path / "tp.py"), moe, str(tmp_path), *arrays, repr(options)], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    single = generate(
        _model(moe, "torch"), ids, attention_mask=mask, return_dict_in_generate=True, return_routed_experts=True,
        **options,
    )  # fmt: skip
    for rank in (0, 1):
        np.testing.assert_array_equal(np.load(tmp_path / f"rank{rank}.npy"), single.routed_experts)
        np.testing.assert_array_equal(np.load(tmp_path / f"prompt{rank}.npy"), single.prompt_routed_experts)
