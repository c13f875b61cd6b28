"""Load on one server: 64 concurrent streaming clients (``openai.AsyncOpenAI``), some leaving
mid-stream, bad requests among them. Every request completes with exactly its own greedy text
(nothing lost, duplicated or mixed with another's), the leavers' slots are freed, the server
stays up.
"""

import asyncio
import json
import signal
import time

import pytest
from demo_task import DEMO_MODEL_DIR, make_prompts
from test_server import Server, curl, expected, post, serve_cmd

CLIENTS = 64
LEAVERS = range(0, CLIENTS, 8)  # these disconnect after their first chunks
MAX_TOKENS = 12
BATCH = 16


@pytest.fixture(scope="module")
def server():
    server = Server(serve_cmd("torch", "--max-batch-size", str(BATCH), "--served-model-name", "demo"))
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log
    assert "Traceback" not in server.log, server.log


def _health(server) -> dict:
    return json.loads(curl(server.url + "/health").stdout)


async def _client(client, i, prompt, want):
    """(i, text, finish_reason); a leaver asks for a long completion and hangs up after 2 chunks."""
    leaver = i in LEAVERS
    stream = await client.completions.create(
        model="demo",
        prompt=prompt,
        temperature=0,
        stream=True,
        max_tokens=400 if leaver else MAX_TOKENS,
        extra_body={"ignore_eos": True} if leaver else None,
    )
    text, reason, seen = "", None, 0
    async for chunk in stream:
        seen += 1
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
        if leaver and seen == 2:
            await stream.close()
            return i, None, "left"
    return i, text, reason


async def _bad(url):
    """Bad requests sent while the clients stream: each a named 400."""
    loop = asyncio.get_running_loop()
    bodies = [
        ('{"prompt": "rev 1 =", "max_tokens": -1}', "max_tokens"),
        ('{"prompt": "rev 1 =", "temperature": -1}', "temperature"),
        ('{"prompt": "rev 1 =", "bogus": 1}', "bogus"),
        ('{"prompt": "' + "9" * 700 + '"}', "prompt"),
        ("{not json", None),
    ]
    out = []
    for body, param in bodies:
        status, text = await loop.run_in_executor(None, post, url + "/v1/completions", body)
        out.append((status, json.loads(text)["error"]["param"], param))
    return out


def test_64_streaming_clients_leavers_and_bad_requests(server, tokenizer):
    pairs = make_prompts(CLIENTS, seed=11)
    prompts = [p for p, _ in pairs]
    want = [
        tokenizer.decode(t, skip_special_tokens=True)
        for t in expected("torch", [tokenizer.encode(p) for p in prompts], MAX_TOKENS)
    ]

    async def run():
        client = server.async_client()
        tasks = [_client(client, i, p, w) for i, (p, w) in enumerate(zip(prompts, want))]
        results, bad = await asyncio.gather(asyncio.gather(*tasks), _bad(server.url))
        await client.close()
        return results, bad

    start = time.perf_counter()
    results, bad = asyncio.run(run())
    elapsed = time.perf_counter() - start
    assert sorted(i for i, _, _ in results) == list(range(CLIENTS))
    for i, text, reason in results:
        if i in LEAVERS:
            assert reason == "left"
        else:
            assert (text, reason) == (want[i], "stop"), (i, prompts[i])
    assert all(status == 400 and got == param for status, got, param in bad), bad
    # the leavers' slots are freed: nothing is left running once everyone is done
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = _health(server)
        if health.get("running", 0) == 0 and health.get("waiting", 0) == 0:
            break
        time.sleep(0.2)
    assert health["status"] == "ok" and health.get("running", 0) == 0, health
    # and the server still answers, at full batch width
    client = server.client()
    for i in range(2):
        out = client.completions.create(model="demo", prompt=prompts[i + 1], max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == want[i + 1]
    print(f"{CLIENTS} clients in {elapsed:.1f} s")


def test_clients_that_leave_free_their_slots_at_once(server):
    """BATCH - 1 clients hang up after their first chunks while one long request keeps running:
    the engine holds only that one request before it is half done."""
    client = server.client()
    long = dict(model="demo", prompt="rev 12345 =", max_tokens=480, temperature=0, extra_body={"ignore_eos": True})
    control = client.completions.create(**long, stream=True)
    leavers = [client.completions.create(**long, stream=True) for _ in range(BATCH - 1)]
    for stream in leavers:
        next(iter(stream))
        stream.close()
    seen, freed = 1, None
    for _chunk in control:
        seen += 1
        if freed is None and seen % 8 == 0:
            health = _health(server)
            if health["running"] == 1:
                freed = seen
    assert seen > 400 and freed is not None and freed < 240, (seen, freed)


def test_non_streaming_clients_that_leave_free_their_slots(server):
    """A client of a whole (non-streamed) completion that times out and hangs up is cancelled too:
    its rows leave the batch long before they would have finished."""
    body = json.dumps(
        {"model": "demo", "prompt": "rev 12345 =", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "n": BATCH}
    )
    args = ["-o", "/dev/null", "-H", "Content-Type: application/json", "-d", body, server.url + "/v1/completions"]
    start = time.perf_counter()
    assert curl(*args).returncode == 0
    full = time.perf_counter() - start
    start = time.perf_counter()
    assert curl("--max-time", "0.2", *args).returncode == 28  # curl's "timed out": it hung up
    while _health(server)["running"] and time.perf_counter() - start < full:
        time.sleep(0.02)
    freed = time.perf_counter() - start
    assert freed < full / 2, (freed, full)


@pytest.fixture(scope="module")
def tokenizer():
    from hyper_gen.jobs.tokenizer import load_tokenizer

    return load_tokenizer(DEMO_MODEL_DIR)
