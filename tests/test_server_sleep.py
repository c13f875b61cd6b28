"""vLLM's sleep / wake-up endpoints on the real engine: ``POST /sleep`` (``?abort=true``),
``POST /wake_up``, ``GET /is_sleeping``.

A real server (``BackgroundServer`` on 127.0.0.1 over the bundled demo model, torch): asleep, the
engine has freed its KV cache and a completion is a 503 naming the sleep; awake again, greedy
completions are the tokens they were before. A sleep while a request runs is a 409 that leaves
the request alone; ``abort=true`` ends it (finish_reason "abort") and sleeps. Needs the engine's
``sleep`` / ``wake_up`` / ``is_sleeping``; the server's side of them is also checked on a
stand-in engine in ``test_server_metrics.py``.
"""

import json
import urllib.error
import urllib.request

import openai
import pytest

PROMPTS = ["rev 12345 =", "rev 908 ="]
LONG = 400  # tokens of a request still running when /sleep arrives (~2 ms each on the demo model)


@pytest.fixture(scope="module")
def served(one_torch_thread):
    from transformers import AutoTokenizer

    from hyper_gen import load_model
    from hyper_gen.demo import demo_model_path
    from hyper_gen.engine import Engine
    from hyper_gen.server import BackgroundServer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    model = load_model(demo_model_path(), backend="torch")
    with Engine(model, tokenizer, max_batch_size=8) as engine, BackgroundServer(engine, tokenizer, "demo") as server:
        yield engine, server


@pytest.fixture
def awake(served):
    """The served engine and server; awake again after the test, whatever it left."""
    engine, server = served
    yield engine, server
    if getattr(engine, "is_sleeping", False):
        engine.wake_up()


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def call(server, method, path):
    """(status, parsed JSON body) of one HTTP request without a body."""
    request = urllib.request.Request(server.url + path, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def greedy(client):
    """Each prompt's greedy completion (12 tokens, EOS ignored) as (text, completion tokens)."""
    found = []
    for prompt in PROMPTS:
        out = client.completions.create(
            model="demo", prompt=prompt, max_tokens=12, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
        )
        choice = out.choices[0]
        found.append((choice.text, choice.logprobs.tokens, out.usage.completion_tokens))
    return found


def long_stream(client):
    """A streamed request of ``LONG`` tokens, running once its first chunk is here: (first chunk,
    the rest), the last chunk being the usage."""
    stream = client.completions.create(
        model="demo",
        prompt=PROMPTS[0],
        max_tokens=LONG,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].finish_reason is None
    return first, chunks


def ending(chunks):
    """(finish_reason, completion tokens) of a streamed response's chunks."""
    return [c for c in chunks if c.choices][-1].choices[0].finish_reason, chunks[-1].usage.completion_tokens


def test_sleep_then_wake_up_gives_the_same_greedy_tokens(awake):
    engine, server = awake
    client = client_of(server)
    before = greedy(client)
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})

    assert call(server, "POST", "/sleep") == (200, {"is_sleeping": True})
    assert engine.is_sleeping
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    error = info.value.body
    assert info.value.status_code == 503 and error["code"] == "engine_sleeping", error
    assert "asleep" in error["message"] and "/wake_up" in error["message"], error
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "rev 1 ="}], max_tokens=4)
    assert info.value.status_code == 503 and info.value.body["code"] == "engine_sleeping"
    assert call(server, "POST", "/sleep") == (200, {"is_sleeping": True})  # asleep already: a no-op
    status, body = call(server, "GET", "/health")  # asleep: a router sends requests elsewhere
    assert status == 503 and body["status"] == "asleep", body

    assert call(server, "POST", "/wake_up") == (200, {"is_sleeping": False})
    assert not engine.is_sleeping
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert greedy(client) == before


def test_sleep_while_a_request_runs_is_409(awake):
    engine, server = awake
    client = client_of(server)
    first, rest = long_stream(client)
    status, body = call(server, "POST", "/sleep")
    assert status == 409, body
    error = body["error"]
    assert error["code"] == "engine_busy" and "abort=true" in error["message"], error
    assert not engine.is_sleeping
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert ending([first, *rest]) == ("length", LONG)  # the refused sleep left the request alone
    assert len(client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=4).choices) == 1


def test_sleep_with_abort_ends_the_running_request(awake):
    engine, server = awake
    client = client_of(server)
    first, rest = long_stream(client)
    assert call(server, "POST", "/sleep?abort=true") == (200, {"is_sleeping": True})
    assert engine.is_sleeping
    reason, generated = ending([first, *rest])
    assert reason == "abort" and 1 <= generated < LONG, (reason, generated)
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert call(server, "POST", "/wake_up") == (200, {"is_sleeping": False})
    out = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert out.choices[0].text == " 54321"
