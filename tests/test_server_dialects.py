"""The routers' dialect (``hyper_gen/server/dialects.py``) on a real server: every field sglang-router
0.3.2 and vllm-router 0.1.17 add to a request is accepted; the honoured ones change the answer as
SGLang / vLLM define them (``no_stop_trim``, ``skip_special_tokens``, ``ignore_eos``,
``continue_final_message``, ``max_completion_tokens``, the reasoning flags, ``/generate``'s
``model``); a value the server cannot honour is a 400 naming the field; a misspelt field is still a
400. Also what the routers read: ``/server_info``, ``/model_info`` (and their ``get_`` names),
vLLM's render endpoints, ``/health`` while paused / draining, and an HTTP/2 (gRPC) probe answered
without a warning.

A ``BackgroundServer`` on 127.0.0.1 over the bundled demo model (torch, ``--reasoning-parser
qwen3``); the same dialect on MindSpore workers is exercised through the routers in ``test_router.py``.
"""

import http.client
import json
import logging
import socket

import openai
import pytest
from demo_task import DEMO_MODEL_DIR

from hyper_gen.server import dialects

PROMPT = "rev 12345 ="  # the demo model answers " 54321" then EOS


@pytest.fixture(scope="module")
def served(one_torch_thread):
    from transformers import AutoTokenizer

    from hyper_gen import load_model
    from hyper_gen.engine import Engine
    from hyper_gen.server import BackgroundServer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = load_model(DEMO_MODEL_DIR, backend="torch")
    with Engine(model, tokenizer, max_batch_size=8) as engine:
        with BackgroundServer(
            engine, tokenizer, "demo", reasoning_parser="qwen3", model_path=DEMO_MODEL_DIR, backend="torch"
        ) as server:
            yield engine, server, tokenizer


def call(server, method, path, body=None):
    """(status, parsed JSON body)."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def post(server, path, body):
    status, out = call(server, "POST", path, body)
    assert status == 200, out
    return out


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def completion(server, **fields):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, **fields}
    return post(server, "/v1/completions", body)["choices"][0]


def chat(server, **fields):
    body = {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10, "temperature": 0}
    return post(server, "/v1/chat/completions", {**body, **fields})["choices"][0]


def generate(server, tokenizer, sampling_params, **fields):
    body = {"input_ids": tokenizer.encode(PROMPT), "sampling_params": {"temperature": 0, **sampling_params}}
    return post(server, "/generate", {**body, **fields})


BASE = {
    "completions": ("/v1/completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
    "chat": (
        "/v1/chat/completions",
        {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0},
    ),
    "generate": ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
}


@pytest.mark.parametrize("router", sorted(dialects.ROUTED))
@pytest.mark.parametrize("endpoint", sorted(BASE))
def test_every_field_a_router_adds_is_accepted_and_changes_nothing(served, router, endpoint):
    _, server, _ = served
    path, body = BASE[endpoint]
    plain = post(server, path, body)
    routed = post(server, path, {**body, **dialects.ROUTED[router][endpoint]})
    if endpoint == "generate":
        assert routed["output_ids"] == plain["output_ids"] and routed["text"] == plain["text"]
    else:
        key = "text" if endpoint == "completions" else "message"
        assert routed["choices"][0][key] == plain["choices"][0][key]


UNHONOURED = [
    (e.name, endpoint, not e.default)
    for e in dialects.EXTENSIONS
    if not e.honoured
    for endpoint in e.endpoints
    if isinstance(e.default, bool)
]


@pytest.mark.parametrize("field,endpoint,value", UNHONOURED)
def test_a_value_the_server_cannot_honour_is_a_400_naming_the_field(served, field, endpoint, value):
    _, server, _ = served
    path, body = BASE[endpoint]
    status, out = call(server, "POST", path, {**body, field: value})
    assert status == 400 and out["error"]["param"] == field, out
    assert field in out["error"]["message"], out


@pytest.mark.parametrize("endpoint", sorted(BASE))
@pytest.mark.parametrize("typo", ["no_stop_trimm", "return_hidden_state", "seperate_reasoning"])
def test_misspelt_fields_are_still_400s(served, endpoint, typo):
    _, server, _ = served
    path, body = BASE[endpoint]
    status, out = call(server, "POST", path, {**body, typo: False})
    assert status == 400 and out["error"]["param"] == typo, out


def test_no_stop_trim_keeps_the_stop_string(served):
    _, server, _ = served
    assert completion(server)["text"] == " 54321"
    assert completion(server, stop=["3"])["text"] == " 54"
    assert completion(server, stop=["3"], no_stop_trim=True)["text"] == " 543"
    assert chat(server, stop=["3"])["message"]["content"] == "54"  # the reply's leading space: the template's
    assert chat(server, stop=["3"], no_stop_trim=True)["message"]["content"] == "543"
    # streamed: the same text, piece by piece
    stream = client_of(server).completions.create(
        model="demo",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stop=["3"],
        stream=True,
        extra_body={"no_stop_trim": True},
    )
    assert "".join(c.choices[0].text for c in stream) == " 543"


def test_no_stop_trim_on_generate(served):
    _, server, tokenizer = served
    assert generate(server, tokenizer, {"stop": "3"})["text"] == " 54"
    kept = generate(server, tokenizer, {"stop": "3", "no_stop_trim": True})
    assert kept["text"] == " 543" and kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": "3"}
    # an EOS that ended the choice: its text stays in with skip_special_tokens false
    eos = generate(server, tokenizer, {"no_stop_trim": True, "skip_special_tokens": False})
    assert eos["text"] == " 54321<eos>" and eos["output_ids"][-1] == tokenizer.eos_token_id


def test_skip_special_tokens_false_decodes_special_tokens(served):
    _, server, tokenizer = served
    skipped = completion(server, ignore_eos=True, max_tokens=8)
    kept = completion(server, ignore_eos=True, max_tokens=8, skip_special_tokens=False)
    assert "<eos>" not in skipped["text"] and "<eos>" in kept["text"], (skipped, kept)
    assert kept["text"].startswith(" 54321<eos>")
    # the EOS that ends a choice stays out, as in vLLM
    assert completion(server, skip_special_tokens=False)["text"] == " 54321"
    streamed = client_of(server).completions.create(
        model="demo",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert "".join(c.choices[0].text for c in streamed) == kept["text"]


def test_ignore_eos_and_max_completion_tokens(served):
    _, server, _ = served
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 9, "temperature": 0}
    assert post(server, "/v1/completions", body)["usage"]["completion_tokens"] == 7  # " 54321" + EOS
    assert post(server, "/v1/completions", {**body, "ignore_eos": True})["usage"]["completion_tokens"] == 9
    reply = client_of(server).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPT}],
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


def test_continue_final_message_continues_the_assistant_message(served):
    _, server, tokenizer = served
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "54"}]
    rendered = post(
        server,
        "/v1/chat/completions/render",
        {"model": "demo", "messages": messages, "continue_final_message": True, "add_generation_prompt": False},
    )
    want = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert want.endswith("54") and rendered["token_ids"] == tokenizer.encode(want, add_special_tokens=False)
    reply = chat(server, messages=messages, continue_final_message=True, add_generation_prompt=False)
    assert reply["message"]["content"] == "321"


def test_reasoning_flags(served):
    _, server, _ = served
    # the prompt opens <think> and the demo model never closes it: all it writes is reasoning
    thinking = {"chat_template_kwargs": {"enable_thinking": True}, "ignore_eos": True}
    split = chat(server, **thinking)["message"]
    assert split["reasoning_content"] and not split["content"], split
    together = chat(server, **thinking, separate_reasoning=False)["message"]
    assert together["content"] == split["reasoning_content"] and together["reasoning_content"] is None
    dropped = chat(server, **thinking, include_reasoning=False)["message"]
    assert dropped["reasoning_content"] is None and not dropped["content"], dropped

    def streamed(**fields):
        stream = client_of(server).chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={**thinking, **fields},
        )
        return [getattr(c.choices[0].delta, "reasoning_content", None) for c in stream if c.choices]

    pieces = [p for p in streamed() if p]
    assert len(pieces) > 1 and "".join(pieces) == split["reasoning_content"]
    assert [p for p in streamed(stream_reasoning=False) if p] == [split["reasoning_content"]]
    assert not any(streamed(include_reasoning=False))


def test_generate_model_is_checked(served):
    _, server, tokenizer = served
    assert generate(server, tokenizer, {}, model="demo")["text"] == " 54321"
    assert generate(server, tokenizer, {}, model=None)["text"] == " 54321"
    status, out = call(server, "POST", "/generate", {"text": PROMPT, "model": "other"})
    assert status == 404 and out["error"]["param"] == "model", out


def test_server_info_and_model_info(served):
    engine, server, _ = served
    for path in ("/server_info", "/get_server_info"):
        status, out = call(server, "GET", path)
        assert status == 200, out
        assert out["model_path"] == DEMO_MODEL_DIR and out["tokenizer_path"] == DEMO_MODEL_DIR
        assert out["served_model_name"] == "demo" and out["is_generation"] is True and out["tp_size"] == 1
        stats = engine.stats()
        assert out["max_total_num_tokens"] == stats["blocks_total"] * stats["block_size"] > 0
        assert out["weight_version"] == "default" and out["max_running_requests"] == 8
    for path in ("/model_info", "/get_model_info"):
        status, out = call(server, "GET", path)
        assert status == 200, out
        assert out["model_path"] == DEMO_MODEL_DIR and out["is_generation"] is True
        assert out["architectures"] == ["Qwen3_5ForCausalLM"] and out["weight_version"] == "default"


def test_render_endpoints_return_the_prompt_token_ids(served):
    _, server, tokenizer = served
    out = post(server, "/v1/completions/render", {"model": "demo", "prompt": [PROMPT, "rev 9 ="], "max_tokens": 3})
    assert [r["token_ids"] for r in out] == [tokenizer.encode(PROMPT), tokenizer.encode("rev 9 =")]
    assert out[0]["model"] == "demo" and out[0]["request_id"].startswith("cmpl-")
    assert out[0]["sampling_params"]["max_tokens"] == 3
    messages = [{"role": "user", "content": PROMPT}]
    one = post(server, "/v1/chat/completions/render", {"model": "demo", "messages": messages, "temperature": 0.5})
    want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert one["token_ids"] == tokenizer.encode(want, add_special_tokens=False)
    assert one["sampling_params"]["temperature"] == 0.5
    status, out = call(server, "POST", "/v1/completions/render", {"model": "demo", "prompt": PROMPT, "n": 0})
    assert status == 400 and out["error"]["param"] == "n", out
    status, out = call(server, "POST", "/v1/chat/completions/render", {"model": "x", "messages": messages})
    assert status == 404, out


def test_health_is_503_while_paused_or_draining(served):
    engine, server, tokenizer = served
    state = server._app.state.hyper_gen
    assert call(server, "GET", "/health") == (200, {"status": "ok", "running": 0, "waiting": 0})
    engine.pause("keep")
    try:
        status, out = call(server, "GET", "/health")
        assert status == 503 and out["status"] == "paused", out
    finally:
        engine.resume()
    state.draining = True  # what SIGTERM sets (launch._Server.handle_exit)
    try:
        status, out = call(server, "GET", "/health")
        assert status == 503 and out["status"] == "draining", out
        status, out = call(server, "POST", *BASE["completions"])
        assert status == 503 and out["error"]["code"] == "server_draining", out
    finally:
        state.draining = False
    assert completion(server)["text"] == " 54321"


def test_an_http2_probe_is_answered_without_a_warning(served, caplog):
    _, server, _ = served
    host, port = server.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.DEBUG, logger="uvicorn.error"):
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
                reply = b""
                while chunk := sock.recv(100):
                    reply += chunk
            # SETTINGS (the server's preface), then GOAWAY with HTTP_1_1_REQUIRED (0xd)
            assert reply == bytes.fromhex("000000040000000000" + "0000080700000000000000000000000d")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert completion(server)["text"] == " 54321"  # HTTP/1.1 as before


def test_a_kept_alive_connection_answers_without_the_delayed_ack_stall(served):
    """A router keeps its connections to a worker open: each answer must not wait 40 ms for the
    client's delayed ACK (Nagle's algorithm holding the body back behind the headers)."""
    import statistics
    import time

    _, server, _ = served
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    took = []
    for _ in range(20):
        began = time.perf_counter()
        conn.request("GET", "/v1/models")
        assert conn.getresponse().read()
        took.append(time.perf_counter() - began)
    conn.close()
    assert statistics.median(took) < 0.025, took  # 40 ms or more each with the stall
