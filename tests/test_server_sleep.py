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
import time
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


def send(server, method, path, body=None):
    """(status, parsed JSON body) of one HTTP request with a JSON ``body``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        server.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    "method,path,body,param",
    [
        ("POST", "/sleep?level=abc", None, "level"),
        ("POST", "/sleep?level=3", None, "level"),
        ("POST", "/sleep?level=0", None, "level"),
        ("POST", "/sleep?levle=1", None, "levle"),
        ("POST", "/sleep?abort=true&abort=false", None, "abort"),
        ("POST", "/sleep?level=1", {"level": 1}, "body"),
        ("POST", "/sleep", {"abort": True}, "body"),
        ("POST", "/wake_up?tags=everything", None, "tags"),
        ("POST", "/wake_up?tag=kv_cache", None, "tag"),
        ("POST", "/wake_up", {"tags": ["kv_cache"]}, "body"),
        ("GET", "/is_sleeping?x=1", None, "x"),
        ("POST", "/flush_cache?all=1", None, "all"),
        ("POST", "/flush_cache", {"all": True}, "body"),
        ("POST", "/pause_generation?mode=abort", None, "mode"),
        ("POST", "/release_memory_occupation?abort=true", None, "abort"),
        ("GET", "/get_weight_version?v=1", None, "v"),
        ("POST", "/update_weights_from_disk?model_path=x", {"model_path": "x"}, "model_path"),
    ],
)
def test_control_endpoints_refuse_what_they_do_not_take(awake, method, path, body, param):
    """Issue 48: ``/sleep?level=abc`` slept (a 200), a body on /sleep was ignored; now each unknown
    or invalid query parameter, and a body where the options are query parameters, is a 400 naming
    it, and the engine is left as it was."""
    engine, server = awake
    status, answer = send(server, method, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert repr(param) in answer["error"]["message"] or param == "body", answer
    assert not engine.is_sleeping and not engine.paused


def test_vllm_sleep_levels_and_wake_tags(awake):
    engine, server = awake
    for level in ("1", "2"):
        assert send(server, "POST", f"/sleep?level={level}") == (200, {"is_sleeping": True})
        assert send(server, "POST", "/wake_up?tags=weights") == (200, {"is_sleeping": True})  # weights never left
        assert send(server, "POST", "/wake_up?tags=weights&tags=kv_cache") == (200, {"is_sleeping": False})
    assert send(server, "POST", "/sleep?level=1&abort=false", {}) == (200, {"is_sleeping": True})
    assert send(server, "POST", "/wake_up") == (200, {"is_sleeping": False})


@pytest.mark.slow
def test_sleep_with_abort_while_clients_keep_sending(awake):
    """Issue 48: ``POST /sleep?abort=true`` while three clients keep sending never answers 409;
    every request is answered (a completion, possibly aborted, or the 503 of a sleeping engine)."""
    import threading

    engine, server = awake
    stop, statuses, unexpected = threading.Event(), [], []

    def send_forever():
        client = client_of(server)
        while not stop.is_set():
            try:
                out = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=6, temperature=0)
                statuses.append(out.choices[0].finish_reason)
            except openai.InternalServerError as error:
                (statuses if error.status_code == 503 else unexpected).append(error.status_code)
            except Exception as error:  # noqa: BLE001 - any other answer is the failure
                unexpected.append(repr(error))

    threads = [threading.Thread(target=send_forever) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(15):
            while len(statuses) < 2:
                time.sleep(0.005)
            assert send(server, "POST", "/sleep?abort=true") == (200, {"is_sleeping": True})
            assert send(server, "POST", "/wake_up") == (200, {"is_sleeping": False})
            statuses.clear()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not unexpected, unexpected[:3]
