"""Rollout outputs with HF's names, against HF ``generate`` on the same model: n samples per prompt
(prefilled once), ``return_dict_in_generate`` with ``scores`` / ``logits``, per-token logprobs, and
``stop_strings``; and the same features on the native models of both backends."""

import warnings

import numpy as np
import pytest
import torch
import transformers
from test_hf_parity import hf_rows, model, padded_batch
from transformers import AutoTokenizer, Qwen3_5ForCausalLM

from hyper_gen import GenerateOutput, generate, load_model
from hyper_gen.demo import demo_model_path

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*fall(ing)? back.*")

SAMPLING = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8)


def _ours_rows(out, lengths):
    return [row[:n] for row, n in zip(out.tolist(), lengths)]


def _generated(ours: GenerateOutput):
    seq = ours.sequences.tolist()
    return [
        seq[i][p : p + g] for i, (p, g) in enumerate(zip(ours.prompt_lengths.tolist(), ours.generated_lengths.tolist()))
    ]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_num_return_sequences_scores_and_logits_equal_hf(kind, one_torch_thread):
    m = model(kind)
    ids, mask = padded_batch()
    common = dict(max_new_tokens=6, num_return_sequences=3, eos_token_id=None, pad_token_id=0, **SAMPLING)
    torch.manual_seed(11)
    hf = m.generate(
        ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True, output_logits=True, **common
    )
    torch.manual_seed(11)
    ours = generate(
        m, ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True, output_logits=True, **common
    )
    assert isinstance(ours, GenerateOutput) and ours.sequences.shape[0] == 9
    hf_mask = mask.repeat_interleave(3, 0)
    expected = [row[ids.shape[1] - int(hf_mask[i].sum()) :] for i, row in enumerate(hf.sequences.tolist())]
    assert [row[: len(ref)] for row, ref in zip(ours.sequences.tolist(), expected)] == expected
    assert len(ours.scores) == len(hf.scores) == 6 and len(ours.logits) == 6
    for mine, theirs in zip(ours.scores, hf.scores):  # HF: after the warpers, -inf where they cut
        assert torch.equal(torch.isinf(mine), torch.isinf(theirs))
        finite = torch.isfinite(theirs)
        torch.testing.assert_close(mine[finite], theirs[finite], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(ours.logits, hf.logits):
        torch.testing.assert_close(mine, theirs.float(), rtol=1e-5, atol=1e-5)


def test_greedy_scores_and_logprobs_equal_log_softmax_of_hf_scores(one_torch_thread):
    m = model("qwen3_5")
    ids, mask = padded_batch()
    hf = m.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=5,
        eos_token_id=None,
        pad_token_id=0,
        do_sample=False,
        repetition_penalty=1.3,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    ours = generate(
        m,
        ids,
        attention_mask=mask,
        max_new_tokens=5,
        eos_token_id=None,
        repetition_penalty=1.3,
        return_dict_in_generate=True,
        output_logprobs=True,
    )
    assert ours.scores is None and ours.logits is None  # only what was asked for
    assert ours.keys() == ["sequences", "prompt_lengths", "generated_lengths", "logprobs", "raw_logprobs"]
    chosen = hf.sequences[:, ids.shape[1] :]
    processed = torch.stack([torch.log_softmax(s, -1) for s in hf.scores], 1).gather(2, chosen[..., None])[..., 0]
    raw = torch.stack([torch.log_softmax(s.float(), -1) for s in hf.logits], 1).gather(2, chosen[..., None])[..., 0]
    torch.testing.assert_close(ours.logprobs, processed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.raw_logprobs, raw, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours.logprobs, ours.raw_logprobs)  # the penalty changed the distribution
    assert _generated(ours) == chosen.tolist()


@pytest.fixture(scope="module")
def demo():
    path = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    hf = Qwen3_5ForCausalLM.from_pretrained(path).eval()
    return path, tokenizer, hf


def _strip(row, pad):
    while row and row[-1] == pad:
        row = row[:-1]
    return row


@pytest.mark.parametrize("stop", [["4"], ["32"], ["= 5"], ["x", "0"]])
def test_stop_strings_end_rows_as_hf_does(demo, stop, one_torch_thread):
    path, tokenizer, hf = demo
    batch = tokenizer(["rev 12345 =", "rev 9031 =", "rev 7 ="], padding=True, return_tensors="pt")
    mask = batch["attention_mask"]
    settings = dict(max_new_tokens=10, stop_strings=stop, tokenizer=tokenizer, pad_token_id=0)
    ref = hf.generate(**batch, do_sample=False, **settings)
    expected = [_strip(row, 0) for row in hf_rows(ref, mask)]
    ours = generate(hf, batch["input_ids"], attention_mask=mask, **settings)
    assert [_strip(row, 0) for row in ours.tolist()] == expected
    native = load_model(path, backend="torch")
    again = generate(native, batch["input_ids"].numpy(), attention_mask=mask.numpy(), **settings)
    assert again.tolist() == ours.tolist()
    assert any(len(row) < int(m.sum()) + 10 and row[-1] != 1 for row, m in zip(expected, mask))  # a stop string hit


def test_stop_strings_without_a_tokenizer_is_a_value_error(demo):
    _, _, hf = demo
    with pytest.raises(ValueError, match="stop_strings=\\['4'\\] needs the tokenizer"):
        generate(hf, [[5, 6, 7]], stop_strings="4")


def test_greedy_with_several_return_sequences_is_refused_as_in_hf(demo):
    _, _, hf = demo
    with pytest.raises(ValueError, match="num_return_sequences=2 needs do_sample=True"):
        generate(hf, [[5, 6, 7]], num_return_sequences=2)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_native_n_samples_prefill_once_and_equal_the_repeated_batch(backend, cache, one_torch_thread):
    """Seeded noise is keyed by the row, so n samples of each prompt equal a batch holding each prompt n
    times; and the logprobs are the log-softmax of the reported scores at the chosen tokens."""
    model_ = load_model(demo_model_path(), backend=backend.name)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path(), padding_side="left")
    batch = tokenizer(["rev 12345 =", "rev 9031 ="], padding=True, return_tensors="np")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    settings = dict(max_new_tokens=8, do_sample=True, seed=3, top_k=0, temperature=8.0, cache_implementation=cache)
    calls = []
    original = model_.construct if backend.name == "mindspore" else model_.forward

    def counting(*args, **kwargs):
        calls.append(args[0].shape if args else kwargs["input_ids"].shape)
        return original(*args, **kwargs)

    if backend.name == "mindspore":
        model_.construct = counting
    else:
        model_.forward = counting
    ours = generate(
        model_,
        ids,
        attention_mask=mask,
        num_return_sequences=3,
        return_dict_in_generate=True,
        output_scores=True,
        output_logprobs=True,
        **settings,
    )
    assert tuple(calls[0]) == ids.shape  # the prefill ran on the 2 prompts, not on 6 rows
    assert all(tuple(shape) == (6, 1) for shape in calls[1:])
    repeated = generate(model_, np.repeat(ids, 3, 0), attention_mask=np.repeat(mask, 3, 0), **settings)
    assert backend.numpy(ours.sequences).tolist() == backend.numpy(repeated).tolist()
    rows = _generated(ours)
    assert len({tuple(r) for r in rows}) > 2  # the samples differ
    logprobs = backend.numpy(ours.logprobs)
    for t, scores in enumerate(ours.scores):
        scores = backend.numpy(scores).astype(np.float64)
        reference = (
            scores
            - np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - scores.max(-1, keepdims=True)
        )
        for i, row in enumerate(rows):
            if t < len(row):
                assert abs(logprobs[i, t] - reference[i, row[t]]) < 1e-4
            else:
                assert logprobs[i, t] == 0.0
