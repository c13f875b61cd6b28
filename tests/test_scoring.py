"""``hyper_gen.score`` (per-token logprobs by teacher forcing in one forward) and generate's
``top_logprobs``, on torch and MindSpore: score on a rollout's sequences gives its ``raw_logprobs``
again, score equals the log-softmax of HF transformers' own forward on the same weights (native
models and an HF model passed in), padding on either side and ``prompt_lengths`` zero what is not
scored, the top tokens are ``topk`` of the raw logits' log-softmax, and bad input is refused naming
the field.

float64 tolerances: both ports' float64 models compute everything in float64 (none of HF's float32
islands: norms, rotary angles, the router, the delta rule), so a cached rollout and a one-forward
score agree to float64 rounding, and their reference is HF computing in float64 (``hf_in_float64``)."""

import numpy as np
import pytest
import torch
from demo_task import DEMO_MODEL_DIR, make_prompts
from model_harness import HFReference
from transformers import AutoTokenizer

from hyper_gen import generate, load_model, score
from hyper_gen.config import MAX_TOP_LOGPROBS

BACKENDS = ["torch", "mindspore"]
VOCAB = 99  # the demo model's
PAD = 0
EOS = 1
_MODELS = {}


def demo(backend, dtype="float32"):
    if (backend, dtype) not in _MODELS:
        _MODELS[backend, dtype] = load_model(DEMO_MODEL_DIR, backend=backend, dtype=dtype, kernels="plain")
    return _MODELS[backend, dtype]


def host(tensor):
    if hasattr(tensor, "asnumpy"):
        return tensor.asnumpy()
    return tensor.detach().cpu().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)


@pytest.fixture(scope="module")
def batch():
    """Three held-out demo prompts of different lengths, left-padded: (input_ids, attention_mask) numpy."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, padding_side="left")
    texts = [p for p, _ in make_prompts(3, seed=7)]
    encoded = tokenizer(texts, padding=True, return_tensors="np")
    ids, mask = encoded["input_ids"].astype(np.int64), encoded["attention_mask"].astype(np.int64)
    assert len(set(mask.sum(1).tolist())) > 1, "the prompts should differ in length"
    return ids, mask


def rollout(model, batch, mode, **extra):
    ids, mask = batch
    sampling = dict(do_sample=True, seed=3, temperature=0.9) if mode == "sampled" else dict(do_sample=False)
    settings = dict(max_new_tokens=8, return_dict_in_generate=True, output_logprobs=True, **sampling)
    return generate(model, ids, attention_mask=mask, **dict(settings, **extra))


def scored_rollout(model, out):
    """score() on a rollout's sequences, as score's docstring calls it: (B, T) numpy."""
    total = out.prompt_lengths + out.generated_lengths
    mask = np.arange(out.sequences.shape[1])[None, :] < total[:, None]
    return host(score(model, out.sequences, mask, out.prompt_lengths))


def rollout_gap(model, out):
    """(max |score - raw_logprobs| at the generated positions, the scores) of a rollout."""
    lp = scored_rollout(model, out)
    raw = host(out.raw_logprobs)
    gap = 0.0
    for i, (p, n) in enumerate(zip(out.prompt_lengths, out.generated_lengths)):
        gap = max(gap, float(np.abs(lp[i, p : p + n] - raw[i, :n]).max()))
        assert (lp[i, :p] == 0).all() and (lp[i, p + n :] == 0).all()  # the prompt and the padding
    return gap, lp


def hf_logprobs(reference, ids, mask):
    """log p(token t | the row's real tokens before t) from HF's own full forward over the padded batch
    (its 2-D mask, positions counting from each row's first real token), float64, 0 where nothing is
    scored: (B, T) numpy. ``reference``: a tests/model_harness.py HFReference."""
    positions = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with reference._context(), torch.no_grad():
        logits = reference.model(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(positions)
        ).logits
    picked = torch.log_softmax(logits[:, :-1].double(), -1).gather(2, torch.from_numpy(ids[:, 1:, None]))[..., 0]
    expected = np.zeros(ids.shape, np.float64)
    expected[:, 1:] = np.where((mask[:, 1:] == 1) & (mask[:, :-1] == 1), picked.numpy(), 0.0)
    return expected


def unpadded_logprobs(reference, ids, mask):
    """The same from HF's forward over each row's real tokens alone (no padding)."""
    expected = np.zeros(ids.shape, np.float64)
    for i in range(ids.shape[0]):
        columns = np.flatnonzero(mask[i])
        logits = reference.logits(ids[i : i + 1, columns])[0]  # (n, V) float64
        logprobs = torch.log_softmax(torch.from_numpy(logits), -1).numpy()
        expected[i, columns[1:]] = logprobs[np.arange(len(columns) - 1), ids[i, columns[1:]]]
    return expected


def padded(rows, side):
    """Rows of token ids padded with PAD on ``side``: (ids, mask) numpy."""
    width = max(map(len, rows))
    ids = np.full((len(rows), width), PAD, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, where] = row
        mask[i, where] = 1
    return ids, mask


ROWS = [[5, 17, 30, 41, 8, 66, 23, 12, 9], [44, 3, 71, 20], [90, 2, 57, 14, 33, 6]]


@pytest.mark.parametrize("prompts", ["task", "random"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_score_of_a_rollout_is_its_raw_logprobs(backend, dtype, mode, prompts, batch, one_torch_thread):
    """``task``: held-out demo prompts, rows ending at EOS; ``random``: arbitrary ids, 12 tokens each."""
    model = demo(backend, dtype)
    if prompts == "task":
        out = rollout(model, batch, mode)
    else:
        batch = padded(ROWS, "left")
        out = rollout(model, batch, mode, max_new_tokens=12, eos_token_id=None)
    assert np.asarray(out.generated_lengths).min() >= 1
    gap, lp = rollout_gap(model, out)
    assert lp.dtype == np.dtype(dtype) and host(out.raw_logprobs).dtype == np.dtype(dtype)
    print(f"{backend} {dtype} {mode} {prompts}: max |raw_logprob - score| = {gap:.3g}")
    assert gap <= (1e-4 if dtype == "float32" else 1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_score_equals_hf_log_softmax_float64(backend, one_torch_thread):
    # both ports compute in float64 throughout, as HF does inside hf_in_float64 (then padding, which
    # moves the delta rule's chunk boundaries, changes nothing)
    reference = HFReference(DEMO_MODEL_DIR, "float64", exact=True)
    for side in ("left", "right"):
        ids, mask = padded(ROWS, side)
        ours = host(score(demo(backend, "float64"), ids, mask))
        assert ours.dtype == np.float64
        padded_hf, alone_hf = hf_logprobs(reference, ids, mask), unpadded_logprobs(reference, ids, mask)
        gaps = np.abs(ours - padded_hf).max(), np.abs(ours - alone_hf).max()
        print(f"{backend} {side}: vs HF padded {gaps[0]:.3g}, alone {gaps[1]:.3g}")
        np.testing.assert_allclose(ours, padded_hf, rtol=0, atol=1e-9)
        np.testing.assert_allclose(ours, alone_hf, rtol=0, atol=1e-9)
        assert (ours[mask == 0] == 0).all() and (ours[np.arange(len(ROWS)), mask.argmax(1)] == 0).all()


def test_mindspore_score_equals_torch_score(one_torch_thread):
    ids, mask = padded(ROWS, "left")
    for dtype, tolerance in (("float64", 1e-12), ("float32", 1e-4)):  # float64: both compute in float64
        theirs = host(score(demo("torch", dtype), torch.from_numpy(ids), torch.from_numpy(mask)))
        ours = host(score(demo("mindspore", dtype), ids, mask))
        print(f"{dtype}: max |mindspore - torch| = {np.abs(ours - theirs).max():.3g}")
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=tolerance)


def test_score_on_an_hf_model(one_torch_thread):
    """score() of HF's model as is; the native torch float64 model's against HF computing in float64."""
    references = HFReference(DEMO_MODEL_DIR, "float64"), HFReference(DEMO_MODEL_DIR, "float64", exact=True)
    prompts = [2, 1, 3]
    for side in ("left", "right"):
        ids, mask = padded(ROWS, side)
        ours = score(references[0].model, torch.from_numpy(ids), torch.from_numpy(mask), prompt_lengths=prompts)
        assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float64 and ours.shape == ids.shape
        expected, exact = (hf_logprobs(reference, ids, mask) for reference in references)
        starts = mask.argmax(1)
        for i, p in enumerate(prompts):
            expected[i, : starts[i] + p] = exact[i, : starts[i] + p] = 0
        np.testing.assert_allclose(ours.numpy(), expected, rtol=0, atol=1e-9)
        native = host(score(demo("torch", "float64"), ids, mask, prompt_lengths=prompts))
        np.testing.assert_allclose(native, exact, rtol=0, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_and_prompt_lengths(backend, one_torch_thread):
    model = demo(backend)
    left = host(score(model, *padded(ROWS, "left")))
    right = host(score(model, *padded(ROWS, "right")))
    both_ids = np.zeros((len(ROWS), 12), np.int64)  # 1 pad on the left, the rest on the right
    both_mask = np.zeros_like(both_ids)
    for i, row in enumerate(ROWS):
        both_ids[i, 1 : 1 + len(row)] = row
        both_mask[i, 1 : 1 + len(row)] = 1
    both = host(score(model, both_ids, both_mask))
    prompts = np.array([3, 1, 6])
    cut = host(score(model, *padded(ROWS, "right"), prompt_lengths=prompts))
    width = left.shape[1]
    for i, row in enumerate(ROWS):
        n = len(row)
        alone = host(score(model, np.array([row])))[0]
        assert alone[0] == 0 and (alone[1:] < 0).all()  # the first token has no context
        np.testing.assert_allclose(left[i, width - n :], alone, rtol=0, atol=1e-5)
        np.testing.assert_allclose(right[i, :n], alone, rtol=0, atol=1e-5)
        np.testing.assert_allclose(both[i, 1 : 1 + n], alone, rtol=0, atol=1e-5)
        assert (left[i, : width - n] == 0).all() and (right[i, n:] == 0).all()
        assert both[i, 0] == 0 and (both[i, 1 + n :] == 0).all()
        p = prompts[i]
        assert (cut[i, :p] == 0).all() and (cut[i, n:] == 0).all()
        np.testing.assert_allclose(cut[i, p:n], alone[p:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_logprobs(backend, batch, one_torch_thread):
    k = 5
    model = demo(backend)
    outs = {}
    for mode in ("greedy", "sampled"):
        out = rollout(model, batch, mode, top_logprobs=k, output_logits=True, max_new_tokens=12)
        outs[mode] = out
        steps = len(out.logits)
        values, ids = host(out.top_logprobs), host(out.top_logprob_ids)
        raw = host(out.raw_logprobs)
        assert values.shape == ids.shape == (3, steps, k) and values.dtype == np.float32 and ids.dtype == np.int64
        chosen = host(out.sequences)
        lengths = np.asarray(out.generated_lengths)
        assert lengths.min() < steps, "a row should end before the others (EOS) to check past its end"
        for t, logits in enumerate(out.logits):
            logprobs = torch.log_softmax(torch.from_numpy(host(logits)).double(), -1)
            top_values, top_ids = torch.topk(logprobs, k, dim=-1)
            for i in range(3):
                if t >= lengths[i]:  # past the row's end
                    assert (values[i, t] == 0).all() and (ids[i, t] == PAD).all()
                    continue
                assert ids[i, t].tolist() == top_ids[i].tolist()
                np.testing.assert_allclose(values[i, t], top_values[i].numpy(), rtol=0, atol=1e-5)
                assert (np.diff(values[i, t]) <= 0).all()
                token = int(chosen[i, out.prompt_lengths[i] + t])
                if token in ids[i, t].tolist():
                    assert raw[i, t] == values[i, t][ids[i, t].tolist().index(token)]
                elif mode == "greedy":
                    pytest.fail(f"greedy token {token} is not among the top {k}")
    wide = rollout(demo(backend, "float64"), batch, "greedy", top_logprobs=k, max_new_tokens=4)
    assert host(wide.top_logprobs).dtype == np.float64
    no_top = rollout(model, batch, "greedy", max_new_tokens=4)
    assert no_top.top_logprobs is None and no_top.top_logprob_ids is None
    if backend == "mindspore":  # the same tokens and top tokens as torch
        theirs = rollout(demo("torch"), batch, "greedy", top_logprobs=k, output_logits=True, max_new_tokens=12)
        ours = outs["greedy"]
        assert host(ours.sequences).tolist() == host(theirs.sequences).tolist()
        assert host(ours.top_logprob_ids).tolist() == host(theirs.top_logprob_ids).tolist()
        np.testing.assert_allclose(host(ours.top_logprobs), host(theirs.top_logprobs), rtol=0, atol=1e-4)


GOOD_IDS = np.array([[5, 6, 7], [8, 9, 10]])
SCORE_CASES = {
    "sequences-1d": (dict(sequences=[5, 6, 7]), ValueError, "sequences"),
    "sequences-float": (dict(sequences=np.array([[5.0, 6.0, 7.0]])), TypeError, "sequences"),
    "sequences-float-list": (dict(sequences=[[5.0, 6.0, 7.0]]), TypeError, "sequences"),  # issue 48: was ValueError
    "sequences-float-fraction": (dict(sequences=[[5.5, 6, 7]]), TypeError, "sequences"),
    "sequences-negative": (dict(sequences=[[5, -6, 7]]), ValueError, "sequences"),
    "sequences-out-of-vocabulary": (dict(sequences=[[5, VOCAB, 7]]), ValueError, "sequences"),
    "sequences-one-token": (dict(sequences=[[5]]), ValueError, "sequences"),
    "mask-shape": (dict(attention_mask=np.ones((2, 2), np.int64)), ValueError, "attention_mask"),
    "mask-not-0-1": (dict(attention_mask=[[1, 2, 1], [1, 1, 1]]), ValueError, "attention_mask"),
    "mask-gap": (dict(attention_mask=[[1, 0, 1], [1, 1, 1]]), ValueError, "attention_mask"),
    "mask-empty-row": (dict(attention_mask=[[1, 1, 1], [0, 0, 0]]), ValueError, "attention_mask"),
    "prompt-lengths-shape": (dict(prompt_lengths=[1, 1, 1]), ValueError, "prompt_lengths"),
    "prompt-lengths-zero": (dict(prompt_lengths=[0, 1]), ValueError, "prompt_lengths"),
    "prompt-lengths-too-long": (dict(prompt_lengths=[1, 4]), ValueError, "prompt_lengths"),
    "prompt-lengths-float": (dict(prompt_lengths=[1.5, 2.0]), TypeError, "prompt_lengths"),
    "prompt-lengths-bool": (dict(prompt_lengths=[True, True]), TypeError, "prompt_lengths"),
}
GENERATE_CASES = {
    "top-logprobs-too-many": (dict(top_logprobs=MAX_TOP_LOGPROBS + 1), ValueError, "top_logprobs"),
    "top-logprobs-negative": (dict(top_logprobs=-1), ValueError, "top_logprobs"),
    "top-logprobs-float": (dict(top_logprobs=2.0), TypeError, "top_logprobs"),
    "top-logprobs-without-logprobs": (dict(top_logprobs=3, output_logprobs=False), ValueError, "top_logprobs"),
}


@pytest.mark.parametrize("case", list(SCORE_CASES) + list(GENERATE_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_names_the_field(backend, case, monkeypatch):
    model = demo(backend)
    calls = []
    if case in SCORE_CASES:
        arguments, error, field = SCORE_CASES[case]
        arguments = dict(dict(sequences=GOOD_IDS), **arguments)
        # refused before the forward
        monkeypatch.setattr(type(model), "__call__", lambda *a, **k: calls.append(1), raising=False)
        with pytest.raises(error, match=field):
            score(model, **arguments)
    else:
        overrides, error, field = GENERATE_CASES[case]
        settings = dict(max_new_tokens=2, return_dict_in_generate=True, output_logprobs=True)
        with pytest.raises(error, match=field):
            generate(model, GOOD_IDS, **dict(settings, **overrides))
    assert not calls


def test_score_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="model"):
        score(None, GOOD_IDS)
