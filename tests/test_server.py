"""``hyper-gen serve`` through the official ``openai`` client and ``curl``, on both backends.

Each backend's server is a real ``python -m hyper_gen serve --port 0`` process (so MindSpore and
torch never share one); what it must answer is computed by plain ``hyper_gen.generate`` in the
test process (``dist_scripts/serve_expected.py``), one prompt at a time.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import openai
import pytest
from demo_task import DEMO_MODEL_DIR, make_prompts
from launch import REPO, _env

READY = re.compile(r"hyper-gen serve: (http://\S+)/v1 ")


class Server:
    """A ``hyper-gen serve`` process (or a launcher running one); ``url`` once it listens."""

    def __init__(self, cmd, timeout=180, env=None):
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env or _env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines, self.url = [], None
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                match = READY.search(line)
                if match and self.url is None:
                    self.url = match.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.kill()
            raise AssertionError("server did not start:\n" + self.log)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self, sig=signal.SIGINT, timeout=60) -> int:
        """Send ``sig`` to the server process; its exit status."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit after {sig!r}:\n" + self.log) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def serve_cmd(backend, *extra):
    return [sys.executable, "-m", "hyper_gen", "serve", "--backend", backend, "--port", "0", *extra]


def curl(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=timeout)


def post(url, body: str, *extra) -> tuple:
    """(HTTP status, response text) of a POST with ``body`` sent verbatim."""
    out = curl("-w", "\n%{http_code}", "-H", "Content-Type: application/json", "-d", body, *extra, url).stdout
    text, _, status = out.rpartition("\n")
    return int(status), text


def expected(backend, prompts, max_tokens, seed=None):
    """Generated token ids per prompt from plain generate (EOS included where it ended)."""
    from dist_scripts.serve_expected import expected as reference

    return reference(backend, [list(ids) for ids in prompts], max_tokens, seed)


@pytest.fixture(scope="module")
def tokenizer():
    from hyper_gen.jobs.tokenizer import load_tokenizer

    return load_tokenizer(DEMO_MODEL_DIR)


PROMPTS = [prompt for prompt, _ in make_prompts(4, seed=3)]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["torch", "mindspore"])
def served(request, tokenizer):
    """(backend, server, greedy reference {prompt text: completion text}) per backend."""
    backend = request.param
    server = Server(serve_cmd(backend, "--max-batch-size", "8", "--served-model-name", "demo"))
    ids = [tokenizer.encode(p) for p in PROMPTS]
    chat_ids = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for p in PROMPTS
    ]
    greedy = expected(backend, ids + chat_ids, MAX_TOKENS)
    reference = {
        "completion": [tokenizer.decode(t, skip_special_tokens=True) for t in greedy[: len(ids)]],
        "chat": [tokenizer.decode(t, skip_special_tokens=True) for t in greedy[len(ids) :]],
        "ids": ids,
        "tokens": greedy[: len(ids)],
    }
    yield backend, server, reference
    status = server.stop(signal.SIGTERM)
    assert status == 0, server.log
    assert "Traceback" not in server.log, server.log


def test_health_and_models_with_curl(served):
    _, server, _ = served
    assert json.loads(curl(server.url + "/health").stdout) == {"status": "ok", "running": 0, "waiting": 0}
    models = json.loads(curl(server.url + "/v1/models").stdout)
    assert [m["id"] for m in models["data"]] == ["demo"] and models["object"] == "list"
    assert server.client().models.list().data[0].id == "demo"


def test_greedy_completions_equal_generate(served):
    backend, server, ref = served
    client = server.client()
    for prompt, ids, want, tokens in zip(PROMPTS, ref["ids"], ref["completion"], ref["tokens"]):
        out = client.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.object == "text_completion" and out.model == "demo"
        assert out.choices[0].text == want, (backend, prompt)
        assert out.choices[0].finish_reason == ("stop" if len(tokens) < MAX_TOKENS or tokens[-1] == 1 else "length")
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(tokens))
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_batch_of_token_id_prompts_with_n(served):
    _, server, ref = served
    out = server.client().completions.create(
        model="demo", prompt=ref["ids"][:2], max_tokens=MAX_TOKENS, n=2, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [ref["completion"][0]] * 2 + [ref["completion"][1]] * 2
    assert out.usage.prompt_tokens == len(ref["ids"][0]) + len(ref["ids"][1])
    assert out.usage.completion_tokens == 2 * (len(ref["tokens"][0]) + len(ref["tokens"][1]))


def test_streamed_completion_equals_the_whole_one(served):
    _, server, ref = served
    stream = server.client().completions.create(
        model="demo",
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["completion"][0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["tokens"][0])


def test_chat_whole_and_streamed(served):
    _, server, ref = served
    client = server.client()
    messages = [{"role": "user", "content": PROMPTS[1]}]
    out = client.chat.completions.create(
        model="demo", messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref["chat"][1]
    assert out.choices[0].finish_reason == "stop"
    parts = list(
        client.chat.completions.create(
            model="demo", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == ref["chat"][1]
    assert parts[-1].choices[0].finish_reason == "stop"


def test_seeds_repeat_and_match_seeded_generate(served):
    backend, server, ref = served
    client = server.client()
    ask = dict(model="demo", prompt=ref["ids"][2], max_tokens=8, temperature=1.0, seed=1234)
    a = client.completions.create(**ask)
    b = client.completions.create(**ask)
    assert a.choices[0].text == b.choices[0].text
    want = expected(backend, [ref["ids"][2]], 8, seed=1234)[0]
    from hyper_gen.jobs.tokenizer import load_tokenizer

    assert a.choices[0].text == load_tokenizer(DEMO_MODEL_DIR).decode(want, skip_special_tokens=True)
    two = client.completions.create(**ask, n=2)
    assert two.choices[0].text == a.choices[0].text  # choice 0 of n draws as a lone request would


def test_logprobs(served):
    _, server, ref = served
    client = server.client()
    out = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    # one entry per counted token: an EOS that ended it shows as "" at the text's end (tests/test_server_echo.py)
    text = out.choices[0].text
    assert "".join(lp.tokens) == text and all(0 <= offset <= len(text) for offset in lp.text_offset)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(
        len(top) == 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs)
    )
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)


def test_stop_strings_and_stop_token_ids(served):
    _, server, ref = served
    client = server.client()
    full = ref["completion"][0]  # " 4321...": stop at its second digit
    out = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[full[2]]
    )
    assert out.choices[0].text == full[: full.index(full[2])] and out.choices[0].finish_reason == "stop"
    stop_id = ref["tokens"][0][1]
    out = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    )
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 2


def test_curl_streams_server_sent_events(served):
    _, server, ref = served
    body = json.dumps(
        {"model": "demo", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    )
    out = curl("-N", "-H", "Content-Type: application/json", "-d", body, server.url + "/v1/completions").stdout
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref["completion"][0]


BAD_REQUESTS = [
    ('{"prompt": "rev 1 =", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "rev 1 =", "temperature": -0.5}', "temperature"),
    ('{"prompt": "rev 1 =", "max_tokenz": 3}', "max_tokenz"),
    ('{"prompt": "' + "1" * 600 + '"}', "prompt"),
    ('{"prompt": "rev 1 =", ', None),
    ('{"prompt": "rev 1 =", "top_p": 0}', "top_p"),
    ('{"prompt": "rev 1 =", "echo": true, "stream": true}', "echo"),
]


def test_bad_requests_get_named_400s_and_others_proceed(served):
    _, server, ref = served
    client = server.client()
    stream = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    first = next(iter(stream))
    for body, param in BAD_REQUESTS:
        status, text = post(server.url + "/v1/completions", body)
        assert status == 400, (body, text)
        error = json.loads(text)["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error
    status, text = post(server.url + "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "n": 0}')
    assert status == 400 and json.loads(text)["error"]["param"] == "n"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="rev 1 =", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    rest = "".join(c.choices[0].text for c in stream)
    assert first.choices[0].text + rest == ref["completion"][0]


def test_sigint_and_sigterm_stop_cleanly():
    for sig in (signal.SIGINT, signal.SIGTERM):
        server = Server(serve_cmd("torch"))
        assert json.loads(curl(server.url + "/health").stdout)["status"] == "ok"
        assert server.stop(sig) == 0, server.log
        assert "hyper-gen serve: stopped" in server.log and "Traceback" not in server.log


def test_bad_flags_are_one_line_exit_2():
    for flags, needle in [
        (["--port", "70000"], "--port"),
        (["--max-batch-size", "0"], "--max-batch-size"),
        (["--backend", "jax"], "unknown backend"),
        (["--model", "/no/such/dir"], "does not exist"),
    ]:
        result = subprocess.run(
            serve_cmd("torch") + flags, capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr
