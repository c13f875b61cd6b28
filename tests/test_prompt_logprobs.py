"""``SamplingParams(prompt_logprobs=k)``: vLLM's prompt logprobs from the engine (torch and MindSpore)
and the OpenAI-compatible server (torch, a real ``hyper-gen serve`` through the ``openai`` client).
They come from the prompt's own prefill forward (chunked, batched with other requests): each prompt
token's logprob is ``hyper_gen.score``'s (to float32's reassociation across batch shapes, and within
1e-9 in float64), the top k are ``topk`` of the log-softmax of HF transformers' own forward on the same
weights."""

import dataclasses
import json
import signal

import numpy as np
import pytest
import torch
from demo_task import make_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from hyper_gen import load_model, score
from hyper_gen.demo import demo_model_path
from hyper_gen.engine import Engine, SamplingParams

BACKENDS = ["torch", "mindspore"]
# |engine - score| in float32: the engine's prefill runs the prompt left-padded beside other requests
# and in chunks, score() alone in one forward, so the products round differently (a few ulps of a
# logprob near -14); float64 pins the math (test_prompt_logprobs_are_score_in_float64)
SAME_AS_SCORE = {"torch": 2e-5, "mindspore": 2e-5}
DEMO = demo_model_path()
_MODELS = {}


def demo(backend):
    if backend not in _MODELS:
        _MODELS[backend] = load_model(DEMO, backend=backend)
    return _MODELS[backend]


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.detach().cpu().numpy()


@pytest.fixture(scope="module")
def prompts():
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    return [tokenizer(p)["input_ids"] for p, _ in make_prompts(3, seed=11)]


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DEMO, torch_dtype=torch.float32).eval()


def hf_log_softmax(hf, prompt):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_are_score_and_hf_topk(backend, prompts, hf, one_torch_thread):
    model = demo(backend)
    k = 5
    with Engine(model, max_batch_size=4) as engine:
        streams = [
            engine.submit(prompts[0], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k)),
            engine.submit(prompts[1], SamplingParams(max_tokens=2, temperature=0)),
            engine.submit(prompts[2], SamplingParams(max_tokens=4, n=2, seed=5, prompt_logprobs=0)),
        ]
        outs = [s.result(timeout=120) for s in streams]
    assert outs[1].prompt_logprobs is None
    for out, prompt, top in ((outs[0], prompts[0], k), (outs[2], prompts[2], 0)):
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        scored = host(score(model, [prompt]))[0]
        reference = hf_log_softmax(hf, prompt)
        values, ids = torch.topk(reference, k, dim=-1)
        for t in range(1, len(prompt)):
            entry = entries[t]
            assert entry["token_id"] == prompt[t]
            assert abs(entry["logprob"] - float(scored[t])) <= SAME_AS_SCORE[backend]
            assert abs(entry["logprob"] - float(reference[t - 1, prompt[t]])) <= 1e-4
            assert len(entry["top_logprobs"]) == top
            assert entry["rank"] == 1 + int((reference[t - 1] > reference[t - 1, prompt[t]]).sum())
            if top:
                got_ids = [i for i, _ in entry["top_logprobs"]]
                got_values = np.array([v for _, v in entry["top_logprobs"]])
                assert got_ids == ids[t - 1].tolist()
                np.testing.assert_allclose(got_values, values[t - 1].numpy(), atol=1e-4)
    assert len(outs[2].outputs) == 2  # n=2: one prompt_logprobs for the request


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_are_score_in_float64(backend, prompts, one_torch_thread):
    """From chunks of 4 positions (each a forward of its own, the last beside another request's
    decode): each prompt token's logprob is score()'s within 1e-9, its rank and top k the same."""
    model = load_model(DEMO, backend=backend, dtype="float64")
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)
    with Engine(model, max_num_batched_tokens=4, block_size=4) as engine:
        other = engine.submit(prompts[1], SamplingParams(max_tokens=8, temperature=0))
        out = engine.submit(prompts[0], params).result(timeout=120)
        other.result(timeout=120)
    scored = host(score(model, [prompts[0]]))[0]
    entries = out.prompt_logprobs
    assert len(entries) == len(prompts[0]) and entries[0] is None
    for t in range(1, len(prompts[0])):
        assert abs(entries[t]["logprob"] - float(scored[t])) <= 1e-9
        assert entries[t]["top_logprobs"][0][1] >= entries[t]["logprob"] - 1e-12


def test_a_one_token_prompt_has_only_none(one_torch_thread):
    with Engine(demo("torch")) as engine:
        out = engine.submit([5], SamplingParams(max_tokens=1, prompt_logprobs=2)).result(timeout=60)
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("bad, error", [(21, ValueError), (-1, ValueError), (True, TypeError), ("2", TypeError)])
def test_bad_prompt_logprobs_are_refused(bad, error):
    with pytest.raises(error, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
    with pytest.raises(error, match="prompt_logprobs"):
        dataclasses.replace(SamplingParams(), prompt_logprobs=bad)


@pytest.fixture(scope="module")
def server():
    from test_server import Server, serve_cmd

    server = Server(serve_cmd("torch", "--max-batch-size", "4", "--served-model-name", "demo"))
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log
    assert "Traceback" not in server.log, server.log


def _check_served_prompt_logprobs(entries, prompt, k, hf, tokenizer):
    """A served ``prompt_logprobs`` list for ``prompt`` (token ids): None, then per token its own entry
    (``score``'s logprob, its rank in HF's log-softmax, its decoded text) and HF's top k."""
    reference = hf_log_softmax(hf, prompt)
    scored = host(score(demo("torch"), [prompt]))[0]
    assert len(entries) == len(prompt) and entries[0] is None
    for t in range(1, len(prompt)):
        entry = entries[t]
        own = entry[str(prompt[t])]
        assert abs(own["logprob"] - float(scored[t])) <= 1e-6
        assert own["rank"] == 1 + int((reference[t - 1] > reference[t - 1, prompt[t]]).sum())
        assert own["decoded_token"] == tokenizer.decode([prompt[t]])
        top = torch.topk(reference[t - 1], k).indices.tolist()
        for rank, token_id in enumerate(top, 1):
            if token_id != prompt[t]:
                assert entry[str(token_id)]["rank"] == rank
                assert abs(entry[str(token_id)]["logprob"] - float(reference[t - 1, token_id])) <= 1e-4
                assert entry[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
        assert set(entry) == {str(i) for i in top} | {str(prompt[t])}


def _refused(server, route, body):
    from test_server import post

    status, text = post(server.url + route, body)
    assert status == 400, (route, body, text)
    error = json.loads(text)["error"]
    assert error["param"] == "prompt_logprobs" and error["type"] == "invalid_request_error", error


def test_server_prompt_logprobs(server, prompts, hf):
    import openai

    client = server.client()
    prompt = prompts[0]
    k = 3
    response = client.completions.create(
        model="demo", prompt=prompt, max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": k}
    )
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    assert len(response.choices) == 2
    for choice in response.choices:
        # vLLM's extra field, kept by the openai client
        _check_served_prompt_logprobs(choice.prompt_logprobs, prompt, k, hf, tokenizer)
    plain = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None
    for bad in ("21", "-1", "true", '"2"', "1.5"):
        _refused(server, "/v1/completions", f'{{"prompt": "rev 1 =", "prompt_logprobs": {bad}}}')
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="rev 1 =", stream=True, extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"


def test_server_chat_prompt_logprobs(server, hf):
    """/v1/chat/completions: the templated prompt's, once at the response's top level (as vLLM's)."""
    import openai

    client = server.client()
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    messages = [{"role": "user", "content": make_prompts(1, seed=12)[0][0]}]
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(templated, add_special_tokens=False)  # as the server encodes a chat (vLLM's way)
    for k in (0, 3):
        response = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": k}
        )
        assert response.usage.prompt_tokens == len(prompt) and len(response.choices) == 2
        assert all(getattr(choice, "prompt_logprobs", None) is None for choice in response.choices)
        _check_served_prompt_logprobs(response.prompt_logprobs, prompt, k, hf, tokenizer)
    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=2, temperature=0)
    assert getattr(plain, "prompt_logprobs", None) is None
    body = '{"messages": [{"role": "user", "content": "rev 1 ="}], "max_tokens": 1, "prompt_logprobs": %s}'
    for bad in ("21", "-1", "true", '"2"', "1.5"):
        _refused(server, "/v1/chat/completions", body % bad)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="demo", messages=messages, stream=True, max_tokens=1, extra_body={"prompt_logprobs": 1}
        )
    assert info.value.body["param"] == "prompt_logprobs"
    assert "stream" in info.value.body["message"]
