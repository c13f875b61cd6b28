"""Hardening of generate() and load_model from Python, on torch and MindSpore: every size generate()
allocates from is bounded before anything is allocated (a ValueError naming the field and the bound),
text instead of token ids says to tokenize first, a Hub id gets the CLI's download hint, and the
output containers index a tensor of either framework with plain Python ints (README's GRPO snippet
runs on MindSpore as on torch)."""

import contextlib
import io
import os
import re

import numpy as np
import pytest
from demo_task import DEMO_MODEL_DIR
from launch import REPO

import hyper_gen.generation as generation_module
from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.config import MAX_NEW_TOKENS, MAX_ROWS, MAX_TOKEN_ID
from hyper_gen.outputs import HostInts

BACKENDS = ["torch", "mindspore"]
IDS = np.array([[5, 6, 7], [0, 8, 9]])
MASK = np.array([[1, 1, 1], [0, 1, 1]])


@pytest.fixture(scope="module", params=BACKENDS)
def model(request):
    if request.param == "torch":
        import torch  # noqa: F401  (the test needs the framework: it fails where it is missing)
    else:
        import mindspore  # noqa: F401
    return load_model(DEMO_MODEL_DIR, backend=request.param)


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if generate() gets as far as building its decode loop (buffers, cache, forwards)."""

    def refuse(*args, **kwargs):
        raise AssertionError("generate() started work before rejecting its input")

    monkeypatch.setattr(generation_module, "make_driver", refuse)


# ---- row 5: sizes --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, needles",
    [
        (dict(do_sample=True, num_return_sequences=10**9), ["num_return_sequences", f"<= {MAX_ROWS}", "MAX_ROWS"]),
        (dict(num_return_sequences=10**9), ["num_return_sequences", f"<= {MAX_ROWS}"]),  # before the greedy rule
        (
            dict(do_sample=True, num_return_sequences=MAX_ROWS),
            [f"2 rows x num_return_sequences={MAX_ROWS}", "MAX_ROWS"],
        ),
        (dict(max_new_tokens=10**30), ["max_new_tokens", f"<= {MAX_NEW_TOKENS}", "MAX_NEW_TOKENS"]),
        (dict(max_new_tokens=10**12, cache_implementation="dynamic"), ["max_new_tokens", "MAX_NEW_TOKENS"]),
        (dict(eos_token_id=10**30), ["eos_token_id", f"<= {MAX_TOKEN_ID}"]),
        (dict(eos_token_id=[1, 2**63]), ["eos_token_id", f"<= {MAX_TOKEN_ID}"]),
        (dict(pad_token_id=2**64), ["pad_token_id", f"<= {MAX_TOKEN_ID}"]),
    ],
)
def test_sizes_are_bounded_before_any_work(model, overrides, needles, no_work):
    with pytest.raises(ValueError) as raised:
        generate(model, IDS, attention_mask=MASK, **overrides)
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))


def test_a_batch_of_more_rows_than_the_bound_is_refused_before_any_work(model, no_work):
    ids = np.ones((MAX_ROWS + 1, 1), dtype=np.int64)
    with pytest.raises(ValueError, match=rf"{MAX_ROWS + 1} rows x num_return_sequences=1 .*MAX_ROWS = {MAX_ROWS}"):
        generate(model, ids, max_new_tokens=1)


def test_bounds_leave_every_real_size_alone(model):
    """Generating "until EOS or the context" (max_new_tokens=10**9) still runs; top_k past the vocabulary keeps it."""
    stop = [lambda ids, scores: ids.shape[1] >= 5]
    out = generate(model, IDS, attention_mask=MASK, max_new_tokens=10**9, eos_token_id=None, stopping_criteria=stop)
    assert tuple(out.shape) == (2, 5)
    sampled = generate(model, IDS, attention_mask=MASK, max_new_tokens=2, do_sample=True, top_k=10**30, seed=0)
    assert tuple(sampled.shape)[0] == 2
    assert GenerationConfig(max_new_tokens=MAX_NEW_TOKENS).max_new_tokens == MAX_NEW_TOKENS
    with pytest.raises(ValueError, match="max_new_tokens must be <= "):
        GenerationConfig(max_new_tokens=MAX_NEW_TOKENS + 1)


# ---- row 7: text instead of token ids ------------------------------------------------------------
@pytest.mark.parametrize(
    "given, kind",
    [
        ("some text", "input_ids is a str"),
        (b"some text", "input_ids is a bytes"),
        (["rev 12 =", "rev 34 ="], "input_ids is a list of strings"),
        ([["rev 12 ="]], "input_ids is a list of lists of strings"),
        (np.array(["rev 12 ="]), "input_ids holds strings"),
    ],
)
def test_text_is_told_to_be_tokenized_first(model, given, kind, no_work):
    with pytest.raises(TypeError) as raised:
        generate(model, given)
    message = str(raised.value)
    assert message.startswith(kind) and "tokenize it first" in message and "tokenizer(" in message, message
    assert isinstance(raised.value, ValueError)  # callers catching the ValueError of earlier versions still do


def test_a_tokenizers_whole_output_and_a_1d_prompt_say_what_to_pass(model, no_work):
    from transformers import AutoTokenizer

    batch = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)(["rev 12 ="], return_tensors="np")
    with pytest.raises(TypeError, match=r"is a BatchEncoding .*batch\['input_ids'\]"):
        generate(model, batch)
    with pytest.raises(ValueError, match=r"got shape \(3,\): one prompt is a batch of one row, \[ids\]"):
        generate(model, [5, 6, 7])


# ---- row 6: a Hub id -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_load_model_of_a_hub_id_says_how_to_download_it(backend):
    with pytest.raises(ValueError) as raised:
        load_model("Qwen/Qwen3.5-0.8B", backend=backend)
    message = str(raised.value)
    assert "is not a local folder" in message, message
    assert "hf download Qwen/Qwen3.5-0.8B --local-dir DIR" in message and "load_model(DIR" in message


def test_load_model_and_the_cli_share_one_wording(tmp_path):
    from hyper_gen.cli.common import model_path
    from hyper_gen.jobs.errors import UsageError
    from hyper_gen.models.checkpoint import folder_problem

    class Args:
        model = None

    for path in ("Qwen/Qwen3.5-0.8B", str(tmp_path / "nowhere"), str(tmp_path)):
        Args.model = path
        with pytest.raises(UsageError) as cli_error:
            model_path(Args)
        with pytest.raises(ValueError) as python_error:
            load_model(path)
        assert str(cli_error.value) == folder_problem(path, "pass --model DIR")
        assert str(python_error.value) == folder_problem(path, "call load_model(DIR, ...)")


# ---- row 8: output containers on both frameworks -------------------------------------------------
def test_output_lengths_are_python_ints_that_slice_either_framework(model):
    out = generate(
        model,
        IDS,
        attention_mask=MASK,
        max_new_tokens=4,
        do_sample=True,
        seed=0,
        num_return_sequences=2,
        return_dict_in_generate=True,
        output_logprobs=True,
        output_scores=True,
    )
    for lengths in (out.prompt_lengths, out.generated_lengths):
        assert isinstance(lengths, HostInts) and isinstance(lengths, np.ndarray) and lengths.dtype == np.int64
        assert lengths.shape == (4,)
        assert all(type(n) is int for n in lengths) and type(lengths[0]) is int
        assert type(lengths.max()) is int and type(lengths.sum()) is int and type(max(lengths)) is int
        assert lengths.tolist() == [int(n) for n in np.asarray(lengths)]
    assert out.prompt_lengths.tolist() == [3, 3, 2, 2]
    for row, (start, n) in enumerate(zip(out.prompt_lengths, out.generated_lengths)):
        tokens = out.sequences[row, start : start + n]
        assert tuple(tokens.shape) == (n,)
        assert tuple(out.logprobs[row, :n].shape) == (n,) and tuple(out.scores[0][row].shape)[0] > 0
    widest = out.generated_lengths.max()
    assert tuple(out.logprobs[:, :widest].shape) == (4, widest)
    assert tuple(out["sequences"][0, : out.prompt_lengths[0]].shape) == (3,)


def _grpo_snippet():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    (snippet,) = [block for block in blocks if "GRPO" in block and 'load_model(path, backend="torch")' in block]
    assert snippet.count('backend="torch"') == 1, snippet
    return snippet


def _run(code):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md GRPO snippet", "exec"), {"__name__": "__readme__"})
    return printed.getvalue()


def test_readmes_grpo_snippet_runs_on_mindspore_as_on_torch():
    """tests/test_readme.py runs the snippet as written (torch); here its backend is MindSpore, whose
    tensors refuse numpy integers as slice bounds: the same lines come out (seed=int: the same tokens)."""
    import mindspore  # noqa: F401
    import torch  # noqa: F401

    snippet = _grpo_snippet()
    torch_lines = _run(snippet).splitlines()
    mindspore_lines = _run(snippet.replace('backend="torch"', 'backend="mindspore"')).splitlines()
    assert torch_lines[0] == "['sequences', 'prompt_lengths', 'generated_lengths', 'logprobs', 'raw_logprobs']"
    assert len(mindspore_lines) == len(torch_lines) == 9, mindspore_lines
    assert mindspore_lines[0] == torch_lines[0]
    for ours, theirs in zip(mindspore_lines[1:], torch_lines[1:]):
        (ours_row, ours_logprob), (theirs_row, theirs_logprob) = ours.rsplit(" ", 1), theirs.rsplit(" ", 1)
        assert ours_row == theirs_row  # the group and the decoded sample
        assert float(ours_logprob) == pytest.approx(float(theirs_logprob), abs=1e-3)
