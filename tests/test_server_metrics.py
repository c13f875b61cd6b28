"""``GET /metrics`` (Prometheus) and the server's side of the engine's sleep / wake-up contract.

A real server (``BackgroundServer`` on 127.0.0.1 over the bundled demo model, torch) is scraped
with ``urllib`` and parsed with prometheus_client's own parser: the request gauges carry
``model_name``, and after completions every metric equals what ``engine.stats()`` says right
after, a key the engine does not report being a metric left out. Servers on stand-in engines
check what the engine cannot show yet: every stats key's metric (names, types, the counters'
``_total``), and ``/sleep``, ``/wake_up``, ``/is_sleeping`` mapped to HTTP (501 for an engine
without them, 409 busy, 503 for a completion while asleep); ``test_server_sleep.py`` runs them on
the real engine. The startup line of the KV cache's budget is ``kv_cache_line``'s.
"""

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hyper_gen.server.metrics import METRICS, kv_cache_line

PROMPT = "rev 12345 ="  # the demo model answers " 54321" then EOS


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hyper_gen.demo import demo_model_path

    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def served(tokenizer, one_torch_thread):
    from hyper_gen import load_model
    from hyper_gen.demo import demo_model_path
    from hyper_gen.engine import Engine
    from hyper_gen.server import BackgroundServer

    model = load_model(demo_model_path(), backend="torch")
    with Engine(model, tokenizer, max_batch_size=8) as engine, BackgroundServer(engine, tokenizer, "demo") as server:
        yield engine, server


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def call(server, method, path, body=None):
    """(status, content type, text) of one HTTP request."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def scrape(server) -> dict:
    """{family name: family} of ``GET /metrics``."""
    status, content_type, text = call(server, "GET", "/metrics")
    assert status == 200, text
    assert content_type.startswith("text/plain; version=0.0.4"), content_type
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families, name, model="demo") -> float:
    """The one sample of ``name`` (a counter's ``<name>_total``), labelled with the served model."""
    samples = families[name].samples
    assert [s.labels for s in samples] == [{"model_name": model}], samples
    return samples[0].value


def wait_idle(engine, timeout_s=10.0) -> None:
    """The engine drops a finished request's row at its next step: wait until it has."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"the engine is still busy: {engine.stats()}")


def error_of(status, content_type, text, want_status) -> dict:
    assert status == want_status, (status, text)
    assert content_type == "application/json", content_type
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- the real engine ---------------------------------------------------------------------------


def test_metrics_parse_and_have_the_request_gauges(served):
    engine, server = served
    wait_idle(engine)
    families = scrape(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert families[name].type == "gauge", families[name]
        assert families[name].documentation
        assert value(families, name) == 0
    assert all(name.startswith(("vllm:", "hyper_gen:")) for name in families), sorted(families)


def test_metrics_after_completions_equal_engine_stats(served):
    engine, server = served
    wait_idle(engine)
    before = scrape(server)
    client = client_of(server)
    prompts = [PROMPT, "rev 908 =", "rev 4711 ="]
    for prompt in prompts:
        out = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text
    wait_idle(engine)
    after = scrape(server)
    stats = engine.stats()  # right after the scrape: the engine is idle, nothing changes between them
    for key, name, kind, _ in METRICS:
        if key not in stats:
            assert name not in after, (name, "is exposed, but engine.stats() has no", key)
            continue
        assert after[name].type == kind, after[name]
        assert value(after, name) == pytest.approx(stats[key]), (name, stats)
        if kind == "counter":
            assert [s.name for s in after[name].samples] == [name + "_total"]
            assert value(after, name) >= value(before, name), name  # cumulative
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    if "kv_cache_usage" in stats:
        assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    if "prefix_cache_hits" in stats and "prefix_cache_queries" in stats:
        assert value(after, "vllm:prefix_cache_hits") <= value(after, "vllm:prefix_cache_queries")


def test_metrics_count_a_request_the_paused_engine_holds(served):
    engine, server = served
    wait_idle(engine)
    want = client_of(server).completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0)
    engine.pause(mode="keep")
    try:
        # the handler queues the request before the stream's headers are sent
        stream = client_of(server).completions.create(
            model="demo", prompt=PROMPT, max_tokens=8, temperature=0, stream=True
        )
        families = scrape(server)
        stats = engine.stats()
        running, waiting = value(families, "vllm:num_requests_running"), value(families, "vllm:num_requests_waiting")
        assert (running, waiting) == (stats["running"], stats["waiting"]) and running + waiting == 1, stats
    finally:
        engine.resume()
    assert "".join(chunk.choices[0].text for chunk in stream) == want.choices[0].text


def test_health_keeps_to_running_and_waiting(served):
    engine, server = served
    wait_idle(engine)
    status, _, text = call(server, "GET", "/health")
    assert status == 200 and json.loads(text) == {"status": "ok", "running": 0, "waiting": 0}


# -- stand-in engines: what the real engine will report, and sleep / wake-up ---------------------

FULL_STATS = {
    "running": 2,
    "waiting": 3,
    "blocks_total": 1000,
    "blocks_used": 250,
    "blocks_cached": 100,
    "blocks_free": 650,
    "prefix_cache_queries": 4096,
    "prefix_cache_hits": 1024,
    "preemptions": 7,
    "cache_memory_bytes": 12 * 2**20,
    "block_size": 16,
    "kv_cache_usage": 0.25,
}


class StatsEngine:
    """An engine the server can read (``stats``) but not run: no sleep, no wake-up."""

    alive = True

    def __init__(self, stats):
        self._stats = dict(stats)

    def stats(self):
        return dict(self._stats)

    def submit(self, prompt_token_ids, params=None, request_id=None):
        raise AssertionError("a stand-in engine takes no requests")


class SleepyEngine(StatsEngine):
    """``StatsEngine`` with the sleep contract: busy while ``running`` + ``waiting`` > 0."""

    def __init__(self, stats):
        super().__init__(stats)
        self.sleeping, self.calls = False, []

    @property
    def is_sleeping(self):
        return self.sleeping

    def sleep(self, abort=False):
        self.calls.append(("sleep", abort))
        busy = self._stats["running"] + self._stats["waiting"]
        if busy and not abort:
            raise RuntimeError(f"{busy} requests are running or waiting")
        self._stats.update(running=0, waiting=0)
        self.sleeping = True

    def wake_up(self):
        self.calls.append(("wake_up",))
        self.sleeping = False

    def submit(self, prompt_token_ids, params=None, request_id=None):
        if self.sleeping:
            raise RuntimeError("the engine is sleeping")
        return super().submit(prompt_token_ids, params, request_id)


@pytest.fixture
def stand_in(tokenizer):
    from hyper_gen.server import BackgroundServer

    servers = []

    def start(engine, name="stand-in"):
        servers.append(BackgroundServer(engine, tokenizer, name))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_every_stats_key_is_its_metric(stand_in):
    server = stand_in(StatsEngine(FULL_STATS), name="org/model-7b")
    families = scrape(server)
    assert sorted(families) == sorted(name for _, name, _, _ in METRICS)
    for key, name, kind, _ in METRICS:
        assert families[name].type == kind
        assert value(families, name, model="org/model-7b") == pytest.approx(FULL_STATS[key])
    _, _, text = call(server, "GET", "/metrics")
    for sample in (
        'vllm:num_requests_running{model_name="org/model-7b"} 2.0',
        'vllm:num_requests_waiting{model_name="org/model-7b"} 3.0',
        'vllm:kv_cache_usage_perc{model_name="org/model-7b"} 0.25',
        'vllm:prefix_cache_queries_total{model_name="org/model-7b"} 4096.0',
        'vllm:prefix_cache_hits_total{model_name="org/model-7b"} 1024.0',
        'vllm:num_preemptions_total{model_name="org/model-7b"} 7.0',
        'hyper_gen:kv_cache_blocks_total{model_name="org/model-7b"} 1000.0',
        'hyper_gen:kv_cache_blocks_used{model_name="org/model-7b"} 250.0',
        'hyper_gen:kv_cache_blocks_cached{model_name="org/model-7b"} 100.0',
        'hyper_gen:kv_cache_memory_bytes{model_name="org/model-7b"} 1.2582912e+07',
    ):
        assert sample in text.splitlines(), (sample, text)
    # /health stays {"status", "running", "waiting"} whatever else stats() reports
    assert json.loads(call(server, "GET", "/health")[2]) == {"status": "ok", "running": 2, "waiting": 3}


def test_a_missing_stats_key_is_a_metric_left_out(stand_in):
    server = stand_in(StatsEngine({"running": 1, "waiting": 0, "kv_cache_usage": None}))
    assert sorted(scrape(server)) == ["vllm:num_requests_running", "vllm:num_requests_waiting"]


def test_servers_in_one_process_keep_their_own_metrics(stand_in):
    one = stand_in(StatsEngine({"running": 1, "waiting": 0}), name="one")
    two = stand_in(StatsEngine({"running": 5, "waiting": 4}), name="two")
    assert value(scrape(one), "vllm:num_requests_running", model="one") == 1
    assert value(scrape(two), "vllm:num_requests_waiting", model="two") == 4


def test_sleep_endpoints_are_501_on_an_engine_without_them(stand_in):
    server = stand_in(StatsEngine({"running": 0, "waiting": 0}))
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        error = error_of(*call(server, method, path), 501)
        assert error["code"] == "not_implemented" and path in error["message"], error
        assert "StatsEngine" in error["message"], error


def test_sleep_contract_as_http(stand_in):
    engine = SleepyEngine({"running": 1, "waiting": 1})
    server = stand_in(engine)
    assert json.loads(call(server, "GET", "/is_sleeping")[2]) == {"is_sleeping": False}
    error = error_of(*call(server, "POST", "/sleep"), 409)
    assert error["code"] == "engine_busy", error
    assert "2 requests are running or waiting" in error["message"] and "abort=true" in error["message"], error
    error = error_of(*call(server, "POST", "/sleep?abort=maybe"), 400)
    assert error["param"] == "abort" and '"maybe"' in error["message"], error
    status, _, text = call(server, "POST", "/sleep?abort=true")
    assert status == 200 and json.loads(text) == {"is_sleeping": True}
    assert engine.calls == [("sleep", False), ("sleep", True)]
    assert json.loads(call(server, "GET", "/is_sleeping")[2]) == {"is_sleeping": True}
    assert call(server, "POST", "/sleep")[0] == 200 and len(engine.calls) == 2  # asleep already: a no-op
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}),
    ):
        error = error_of(*call(server, "POST", path, body), 503)
        assert error["code"] == "engine_sleeping" and "asleep" in error["message"] and "/wake_up" in error["message"]
    with pytest.raises(openai.InternalServerError) as info:
        client_of(server).completions.create(model="stand-in", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "engine_sleeping"
    assert scrape(server)  # metrics answer while asleep
    status, _, text = call(server, "POST", "/wake_up")
    assert status == 200 and json.loads(text) == {"is_sleeping": False}
    assert call(server, "POST", "/wake_up")[0] == 200 and engine.calls[-1] == ("wake_up",) and len(engine.calls) == 3


# -- the startup line ----------------------------------------------------------------------------


def test_kv_cache_line():
    assert kv_cache_line(FULL_STATS) == "KV cache: 1000 blocks of 16 tokens, 12.0 MiB"
    assert kv_cache_line({"cache_memory_bytes": 3 * 2**30 + 2**29, "blocks_total": 7}) == "KV cache: 7 blocks, 3.5 GiB"
    assert kv_cache_line({"cache_memory_bytes": 512}) == "KV cache: 512 B"
    assert kv_cache_line({"running": 0, "waiting": 0}) is None
