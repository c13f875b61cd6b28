"""What must not break the engine: a model that raises, a bug in the engine itself, models it
cannot batch, text split inside a character or a stop string; and the RFC-contract path
(a model that returns its past) on both backends."""

import functools
import time
import types

import pytest
from test_streaming import byte_tokenizer

from hyper_gen import generate
from hyper_gen.engine import Engine, EngineDeadError, SamplingParams
from hyper_gen.engine.detokenize import IncrementalText


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.numpy()


def failing(model, backend):
    """``model`` whose forward raises RuntimeError("boom") while ``model.boom`` is set."""
    name = "construct" if backend.name == "mindspore" else "forward"
    original = getattr(model, name)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if model.boom:
            raise RuntimeError("boom")
        return original(*args, **kwargs)

    model.boom = False
    object.__setattr__(model, name, forward)
    return model


def stub_reference(model, prompt, steps):
    return host(generate(model, [prompt], max_new_tokens=steps, eos_token_id=None))[0, len(prompt) :].tolist()


def test_rfc_models_batch_like_generate(backend):
    model = backend.stub()
    prompts = [[5, 6, 7], [9], [1, 2, 3, 4, 5, 6, 7], [8, 8]]
    with Engine(model, max_batch_size=2, max_model_len=64) as engine:
        outs = engine.run_batch([(p, SamplingParams(max_tokens=4 + i, temperature=0)) for i, p in enumerate(prompts)])
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == stub_reference(model, prompt, 4 + i)


def test_a_model_error_fails_the_requests_in_flight_and_the_engine_goes_on(backend):
    model = failing(backend.stub(), backend)
    with Engine(model, max_model_len=100) as engine:
        running = [engine.submit([3, 4, 5], SamplingParams(max_tokens=60, temperature=0)) for _ in range(2)]
        next(iter(running[0]))
        model.boom = True
        for stream in running:
            with pytest.raises(RuntimeError, match="boom"):
                stream.result(timeout=60)
            with pytest.raises(RuntimeError, match="boom"):
                list(stream)
        refused = engine.submit([7, 8], SamplingParams(max_tokens=3, temperature=0))  # its prefill raises
        with pytest.raises(RuntimeError, match="boom"):
            refused.result(timeout=60)
        model.boom = False
        again = engine.submit([3, 4, 5], SamplingParams(max_tokens=5, temperature=0)).result(timeout=60)
        assert again.outputs[0].token_ids == stub_reference(model, [3, 4, 5], 5)
        assert engine.alive


def test_an_engine_bug_kills_it_loudly_instead_of_hanging(backend, monkeypatch):
    import hyper_gen.engine.draws as draws_module

    model = backend.stub()
    with Engine(model, max_model_len=100) as engine:
        first = engine.submit([3, 4, 5], SamplingParams(max_tokens=50, temperature=0))
        next(iter(first))
        monkeypatch.setattr(draws_module, "select_rows", lambda *a, **k: {}["bug"])
        with pytest.raises(EngineDeadError, match="KeyError"):
            first.result(timeout=60)
        deadline = time.time() + 30
        while engine.alive and time.time() < deadline:
            time.sleep(0.01)
        with pytest.raises(EngineDeadError):
            engine.submit([1, 2])


def test_models_the_engine_cannot_batch_are_refused():
    import transformers

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10))
    with pytest.raises(TypeError, match="unmodified HF transformers models"):
        Engine(hf)
    with pytest.raises(TypeError, match="takes no past_key_values, attention_mask, position_ids"):
        Engine(lambda input_ids: None)
    with pytest.raises(TypeError, match="callable model"):
        Engine(None)

    def context_parallel(input_ids, position_ids=None, attention_mask=None, past_key_values=None):
        return None

    context_parallel.cp_plan = types.SimpleNamespace(cp=2)  # what load_model(cp=2) models carry
    with pytest.raises(TypeError, match="does not batch context-parallel models"):
        Engine(context_parallel)


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
        ("temperature", -0.5, "temperature must be >= 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("n", 0, "n must be >= 1"),
        ("seed", -3, "seed must be in"),
        ("top_k", -2, "top_k must be >= -1"),
        ("min_p", 2.0, r"min_p must be in \[0, 1\]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("logprobs", 21, r"logprobs must be in \[0, 20\]"),
        ("min_tokens", 40, r"min_tokens must be <= max_tokens \(16\)"),
        ("stop", [""], "stop strings must not be empty"),
        ("temperature", float("nan"), "temperature must be finite"),
    ],
)
def test_sampling_params_name_the_bad_field(field, value, error):
    with pytest.raises(ValueError, match=error):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [("stop", 3), ("stop", ["a", 1]), ("n", 1.5), ("seed", "1"), ("ignore_eos", 1), ("stop_token_ids", "1")],
)
def test_sampling_params_type_errors(field, value):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_vllm_conventions():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(stop="x").stop == ["x"]


def hf_bytes():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer())


def test_multibyte_characters_are_never_broken():
    tok = hf_bytes()
    ids = tok("aé中b", add_special_tokens=False)["input_ids"]
    text = IncrementalText(tok, [])
    pieces = [text.update(ids[: i + 1])[0] for i in range(len(ids))]
    assert pieces == ["a", "", "é", "", "", "中", "b"]
    assert text.finish() == ""


def test_stop_strings_never_reach_the_stream():
    tok = hf_bytes()
    ids = tok("say hello world", add_special_tokens=False)["input_ids"]
    text = IncrementalText(tok, ["lo w", "zz"])
    pieces, stopped = [], False
    for i in range(len(ids)):
        piece, stopped = text.update(ids[: i + 1])
        pieces.append(piece)
        if stopped:
            break
    assert stopped and "".join(pieces) == "say hel" == text.text
    unfinished = IncrementalText(tok, ["xyz"])
    streamed = "".join(unfinished.update(ids[: i + 1])[0] for i in range(len(ids)))
    assert streamed == "say hello wor"  # two characters held back: they could start "xyz"
    assert streamed + unfinished.finish() == "say hello world"


def test_stream_text_with_a_byte_tokenizer_adds_up(backend):
    """Through the engine: chunks of a byte-level vocabulary never split a character (a U+FFFD
    emitted for a partial character would make the chunks differ from the final decode)."""
    tok = hf_bytes()
    model = backend.stub(vocab_size=256)
    with Engine(model, tok, max_model_len=100) as engine:
        stream = engine.submit([200, 201, 202], SamplingParams(max_tokens=30, seed=2, temperature=1.0))
        chunks = list(stream)
        out = stream.result()
    assert "".join(c.text for c in chunks) == out.outputs[0].text
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
