"""The server's answers to what clients get wrong, and to a server that stops under load.

Every error is OpenAI's schema (``{"error": {"message", "type", "param", "code"}}``, JSON, never
Starlette's text/plain) with the right status, naming the parameter and the value; every size a
request names is bounded before any work; logprobs join to exactly the text returned; a SIGTERM
ends every open response well-formed. A real server (``BackgroundServer`` on 127.0.0.1 over the
bundled demo model, torch) answers the official ``openai`` client and raw ``http.client``
requests (for bodies no client would send). None of this depends on the backend: the body,
the errors and the logprobs' alignment are the server's and the tokenizer's, not the model's.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
from launch import REPO, _env

PROMPT = "rev 12345 ="  # the demo model answers " 54321" then EOS


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hyper_gen.demo import demo_model_path

    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def server(tokenizer, one_torch_thread):
    from hyper_gen import load_model
    from hyper_gen.demo import demo_model_path
    from hyper_gen.engine import Engine
    from hyper_gen.server import BackgroundServer

    model = load_model(demo_model_path(), backend="torch")
    with Engine(model, tokenizer, max_batch_size=8) as engine, BackgroundServer(engine, tokenizer, "demo") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def request(server, method, path, body=None, headers=None):
    """(status, headers, text) of one raw HTTP request; ``body`` is sent verbatim (str: as UTF-8)."""
    host, port = server.url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        if isinstance(body, str):
            body = body.encode("utf-8")
        conn.request(
            method, path, body=body, headers={"Content-Type": "application/json"} if headers is None else headers
        )
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode("utf-8")
    finally:
        conn.close()


def error_of(status, headers, text, want_status):
    """The ``error`` object of an OpenAI-schema error response with ``want_status``."""
    assert status == want_status, (status, text)
    assert headers["content-type"] == "application/json", headers
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


def bad(server, body, param, path="/v1/completions", status=400):
    """The error of a request that must be a ``status`` naming ``param``."""
    error = error_of(*request(server, "POST", path, body), status)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error", error
    return error


# -- 1. a lone UTF-16 surrogate ------------------------------------------------------------------


def test_a_lone_surrogate_is_a_400_naming_where_it_is(server):
    error = bad(server, '{"prompt": "rev 1 =\\ud800", "max_tokens": 2}', "prompt")
    assert "surrogate" in error["message"] and "\\ud800" in error["message"]
    chat = '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'
    error = bad(server, chat, "messages.0.content.0.text", "/v1/chat/completions")
    assert "\\udfff" in error["message"]
    assert bad(server, '{"prompt": "x", "stop": ["a", "\\ud83d"]}', "stop.1")
    # a surrogate pair is one character: fine
    status, _, text = request(server, "POST", "/v1/completions", '{"prompt": "rev 1 =\\ud83d\\ude00", "max_tokens": 1}')
    assert status == 200, text
    # bytes that are not UTF-8 at all
    error = error_of(*request(server, "POST", "/v1/completions", b'{"prompt": "\xff"}'), 400)
    assert "UTF-8" in error["message"] and error["code"] == "invalid_json"


# -- 2. an empty stop string ---------------------------------------------------------------------


@pytest.mark.parametrize("stop", ['""', '[""]', '["x", ""]'])
def test_an_empty_stop_string_is_a_400_naming_stop(server, stop):
    error = bad(server, f'{{"prompt": "rev 1 =", "max_tokens": 2, "stop": {stop}}}', "stop")
    assert "empty" in error["message"]
    bad(server, f'{{"messages": [{{"role": "user", "content": "x"}}], "stop": {stop}}}', "stop", "/v1/chat/completions")


def test_an_empty_stop_string_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="rev 1 =", max_tokens=2, stop="")
    assert info.value.body["param"] == "stop"


# -- 3. GET /v1/models/{id} ----------------------------------------------------------------------


def test_models_retrieve_serves_the_model_card(server, client):
    card = client.models.retrieve("demo")
    assert (card.id, card.object, card.owned_by) == ("demo", "model", "hyper_gen")
    assert card.created == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    error = error_of(*request(server, "GET", "/v1/models/org/other-model"), 404)
    assert "'org/other-model'" in error["message"]


# -- 5. logprobs join to the returned text ----------------------------------------------------


def _check_completion_logprobs(text, lp):
    assert "".join(lp.tokens) == text, (lp.tokens, text)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(0 <= offset <= len(text) for offset in lp.text_offset), (lp.text_offset, text)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


@pytest.mark.parametrize("stop", [None, "2", "21"], ids=["eos", "stop-token", "stop-string-over-two-tokens"])
def test_completion_logprobs_are_the_tokens_of_the_text(client, stop):
    want = " 54321"[: " 54321".index(stop)] if stop else " 54321"
    ask = dict(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, stop=stop)
    out = client.completions.create(**ask)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (want, "stop")
    _check_completion_logprobs(choice.text, choice.logprobs)
    # the tokens that ended it (EOS, the stop string's) count as generated, their entries "" at the text's end
    assert out.usage.completion_tokens == len(want) + (len(stop) if stop else 1) == len(choice.logprobs.tokens)
    ended = choice.logprobs.tokens[len(want) :]
    assert ended == [""] * (len(stop) if stop else 1) and set(choice.logprobs.text_offset[len(want) :]) == {len(want)}
    # streamed: the same tokens, each once its text is out
    chunks = [c for c in client.completions.create(**ask, stream=True) if c.choices]
    text = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert (text, tokens, offsets) == (want, choice.logprobs.tokens, choice.logprobs.text_offset)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_the_tokens_of_the_text(client, stream):
    ask = dict(
        model="demo",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    for stop in (None, "3"):
        if stream:
            parts = [p for p in client.chat.completions.create(**ask, stop=stop, stream=True) if p.choices]
            text = "".join(p.choices[0].delta.content or "" for p in parts)
            content = [t for p in parts if p.choices[0].logprobs for t in p.choices[0].logprobs.content]
        else:
            out = client.chat.completions.create(**ask, stop=stop)
            text, content = out.choices[0].message.content, out.choices[0].logprobs.content
            assert len(content) == out.usage.completion_tokens  # the EOS / stop tokens too, as ""
        assert text and "".join(t.token for t in content) == text, (stop, [t.token for t in content], text)
        assert all(bytes(t.bytes).decode("utf-8") == t.token and len(t.top_logprobs) == 2 for t in content)


# -- 6. strict JSON types, missing parameters, max_tokens beyond the context ----------------------

TYPE_ERRORS = [
    ('{"prompt": "rev 1 =", "n": "2"}', "n", '"2"'),
    ('{"prompt": "rev 1 =", "n": true}', "n", "true"),
    ('{"prompt": "rev 1 =", "n": 2.0}', "n", "2.0"),
    ('{"prompt": "rev 1 =", "temperature": "0"}', "temperature", '"0"'),
    ('{"prompt": "rev 1 =", "max_tokens": false}', "max_tokens", "false"),
    ('{"prompt": "rev 1 =", "logprobs": true}', "logprobs", "true"),
    ('{"prompt": "rev 1 =", "stream": "true"}', "stream", '"true"'),
    ('{"prompt": "rev 1 =", "seed": "7"}', "seed", '"7"'),
    ('{"prompt": [true, false]}', "prompt", "[true, false]"),
    ('{"prompt": 5}', "prompt", "5"),
    ('{"prompt": [[1, "a"]]}', "prompt.0.1", '"a"'),
    ('{"prompt": "rev 1 =", "stop": 3}', "stop", "3"),
    ('{"prompt": "rev 1 =", "model": 1}', "model", "1"),
    (
        '{"prompt": "rev 1 =", "stream": true, "stream_options": {"include_usage": 1}}',
        "stream_options.include_usage",
        "1",
    ),
]


@pytest.mark.parametrize("body, param, value", TYPE_ERRORS, ids=[p for _, p, _ in TYPE_ERRORS])
def test_json_types_are_strict(server, body, param, value):
    error = bad(server, body, param)
    assert f"'{param}'" in error["message"] and value in error["message"], error


def test_chat_types_are_strict(server):
    path = "/v1/chat/completions"
    bad(server, '{"messages": [{"role": "user", "content": "x"}], "logprobs": 1}', "logprobs", path)
    bad(server, '{"messages": [{"role": "user", "content": 5}]}', "messages.0.content", path)
    bad(
        server,
        '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": "2", "logprobs": true}',
        "top_logprobs",
        path,
    )


@pytest.mark.parametrize("path, param", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
@pytest.mark.parametrize("body", ["", "  \n", "{}"], ids=["empty", "blank", "empty-object"])
def test_a_missing_body_names_the_required_parameter(server, path, param, body):
    error = bad(server, body, param, path)
    assert f"missing required parameter '{param}'" in error["message"] and "None" not in error["message"]


def test_max_tokens_beyond_the_context_names_max_tokens(server, client):
    error = bad(server, '{"prompt": "rev 1 =", "max_tokens": 1000000000}', "max_tokens")
    assert "1000000000" in error["message"] and "511" in error["message"] and "512" in error["message"]
    path = "/v1/chat/completions"
    for param in ("max_tokens", "max_completion_tokens"):
        body = f'{{"messages": [{{"role": "user", "content": "x"}}], "{param}": 1000000000}}'
        assert "511" in bad(server, body, param, path)["message"]
    # a prompt that fits, but not with its max_tokens: the prompt is what to shorten
    assert bad(server, json.dumps({"prompt": [5] * 500, "max_tokens": 100}), "prompt")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="rev 1 =", max_tokens=10**9)
    assert info.value.body["param"] == "max_tokens"


# -- 7. content type and invalid JSON ------------------------------------------------------------


def test_a_body_not_sent_as_json_says_so(server):
    body = '{"prompt": "rev 1 =", "max_tokens": 2}'
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # what curl -d sends
    error = error_of(*request(server, "POST", "/v1/completions", body, form), 415)
    assert "application/x-www-form-urlencoded" in error["message"] and "application/json" in error["message"]
    error = error_of(*request(server, "POST", "/v1/chat/completions", body, {}), 415)
    assert "no Content-Type" in error["message"]
    for ok in ("application/json; charset=utf-8", "Application/JSON"):
        status, _, text = request(server, "POST", "/v1/completions", body, {"Content-Type": ok})
        assert status == 200, (ok, text)


def test_invalid_json_gets_the_parsers_whole_message(server):
    error = bad(server, '{"prompt": "rev 1 =", ', None)
    assert error["code"] == "invalid_json"
    assert error["message"].endswith("line 1 column 23 (char 22)"), error["message"]
    error = bad(server, '{"prompt": "rev 1 =", "temperature": NaN}', None)
    assert "NaN" in error["message"] and error["code"] == "invalid_json"
    error = bad(server, '{"prompt": "rev 1 =", "max_tokens": 1' + "0" * 5000 + "}", None)
    assert error["code"] == "invalid_json"
    assert "got a list" in bad(server, "[1, 2]", None)["message"]
    assert "got a string" in bad(server, '"rev 1 ="', None)["message"]
    assert "nested too deeply" in bad(server, "[" * 100_000 + "]" * 100_000, None)["message"]


# -- every error path in OpenAI's schema ---------------------------------------------------------


def test_unknown_routes_methods_and_handler_failures_are_openai_errors(server, monkeypatch):
    error = error_of(*request(server, "GET", "/v1/nope"), 404)
    assert "/v1/nope" in error["message"]
    status, headers, text = request(server, "DELETE", "/v1/completions")
    assert "DELETE" in error_of(status, headers, text, 405)["message"] and headers.get("allow") == "POST"
    assert error_of(*request(server, "POST", "/v1/models"), 405)

    import hyper_gen.server.completions as completions

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a handler")

    monkeypatch.setattr(completions, "checked_completion", broken)
    error = error_of(*request(server, "POST", "/v1/completions", '{"prompt": "rev 1 ="}'), 500)
    assert "a bug in a handler" in error["message"] and error["type"] == "internal_server_error"


def test_bytes_that_are_not_http_get_an_openai_error(server):
    host, port = server.url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = b""
        while data := sock.recv(65536):
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), reply
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


# -- every size a request names is bounded, before any work --------------------------------------

SIZES = [
    ({"n": 129}, "n", "/v1/completions"),
    ({"n": 9}, "n", "/v1/completions"),  # more than the engine's max_batch_size=8
    ({"logprobs": 21}, "logprobs", "/v1/completions"),
    ({"best_of": 10**9}, "best_of", "/v1/completions"),
    ({"stop": ["x"] * 33}, "stop", "/v1/completions"),
    ({"stop": "x" * 1025}, "stop", "/v1/completions"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids", "/v1/completions"),
    ({"prompt": ["rev 1 ="] * 2049}, "prompt", "/v1/completions"),
    ({"prompt": [5] * 100_000}, "prompt", "/v1/completions"),
    ({"prompt": "1" * 600}, "prompt", "/v1/completions"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "/v1/chat/completions"),
    ({"n": 129}, "n", "/v1/chat/completions"),
    ({"messages": [{"role": "user", "content": "1" * 600}]}, "messages", "/v1/chat/completions"),
    ({"seed": 2**64}, "seed", "/v1/completions"),
    ({"min_tokens": 10**9}, "min_tokens", "/v1/completions"),
]


@pytest.mark.parametrize("fields, param, path", SIZES, ids=[f"{p.split('/')[-1]}-{k}" for _, k, p in SIZES])
def test_every_size_is_bounded_with_a_400_naming_it(server, fields, param, path):
    base = (
        {"prompt": "rev 1 =", "max_tokens": 4}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    start = time.monotonic()
    bad(server, json.dumps({**base, **fields}), param, path)
    assert time.monotonic() - start < 5


def test_a_body_larger_than_the_limit_is_a_413_before_it_is_read(server):
    declared = 1 << 30  # a client announcing 1 GiB: answered before a byte more is read
    host, port = server.url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": "')
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 413 " in status_line, reply
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert str(declared) in error["message"] and error["code"] == "request_too_large"


def test_the_server_still_serves_after_all_of_that(client):
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == " 54321"


# -- 4. SIGTERM while requests outlive the grace period -------------------------------------------

# a server process over a demo model slowed to ~40 steps/s, one row at a time, 0.5 s of grace:
# every request below outlives it
SLOW_SERVER = """
import sys, time
from transformers import AutoTokenizer
from hyper_gen import load_model
from hyper_gen.demo import demo_model_path
from hyper_gen.engine import Engine
from hyper_gen.server.launch import bind, serve

path = demo_model_path()
model = load_model(path, backend="torch")
tokenizer = AutoTokenizer.from_pretrained(path)
forward = model.forward
def slow_forward(*args, **kwargs):
    time.sleep(0.025)
    return forward(*args, **kwargs)
model.forward = slow_forward
engine = Engine(model, tokenizer, max_batch_size=2).start()
sock = bind("127.0.0.1", 0)
port = sock.getsockname()[1]
serve(engine, tokenizer, "demo", sock, grace_s=0.5, on_started=lambda: print("READY", port, flush=True))
print("STOPPED", flush=True)
"""


def _sse_events(text):
    return [event[len("data: ") :] for event in text.split("\n\n") if event.startswith("data: ")]


@pytest.mark.slow
def test_sigterm_ends_every_open_request_well_formed():
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_SERVER],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, ready = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(120) and any(line.startswith("READY") for line in lines), "".join(lines)
        port = int(next(line for line in lines if line.startswith("READY")).split()[1])
        server = type("S", (), {"url": f"http://127.0.0.1:{port}"})()
        long = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
        bodies = {
            "completion-stream": ("/v1/completions", {"prompt": PROMPT, "stream": True, **long}),
            "completion": ("/v1/completions", {"prompt": PROMPT, **long}),
            "chat-stream": (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": PROMPT}], "stream": True, **long},
            ),
            "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], **long}),
        }
        results = {}

        def send(name, path, body):
            results[name] = request(server, "POST", path, json.dumps(body))

        threads = [threading.Thread(target=send, args=(name, *job)) for name, job in bodies.items()]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # two running (max_batch_size=2), two waiting
            load = json.loads(request(server, "GET", "/health")[2])
            if load["running"] + load["waiting"] == 4:
                break
            time.sleep(0.05)
        assert load["running"] + load["waiting"] == 4, load
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        assert proc.wait(30) == 0, "".join(lines)
        assert time.monotonic() - sent < 10
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    log = "".join(lines)
    assert "STOPPED" in log and "Traceback" not in log, log
    for name in ("completion", "chat"):
        error = error_of(*results[name], 503)
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"], error
    for name in ("completion-stream", "chat-stream"):
        status, headers, text = results[name]
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), results[name]
        events = _sse_events(text)
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["error"]["code"] == "server_shutting_down", last
        assert all("error" not in json.loads(e) for e in events[:-2])
