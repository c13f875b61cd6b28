"""``hyper-gen serve`` driven as an RL framework drives SGLang: raw HTTP on 127.0.0.1, token ids in
and out (``POST /generate``, vLLM's ``return_token_ids``), the control endpoints, partial rollout.

Each backend's server is a real ``python -m hyper_gen serve --port 0`` process; the tokens and
logprobs it must answer come from plain ``hyper_gen.generate`` in another process
(``dist_scripts/serve_expected_logprobs.py``).
"""

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest
from demo_task import DEMO_MODEL_DIR, make_prompts
from launch import REPO, _env, script
from test_server import Server, serve_cmd

MAX_TOKENS = 12


class Http:
    """Raw HTTP/1.1 JSON calls, as SGLang's clients make them (a connection per call: thread-safe)."""

    def __init__(self, url):
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port

    def _send(self, method, path, body):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        data = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        conn.request(method, path, body=data, headers=headers)
        return conn, conn.getresponse()

    def call(self, method, path, body=None):
        conn, response = self._send(method, path, body)
        try:
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()

    def post(self, path, body=None):
        return self.call("POST", path, body)

    def get(self, path):
        return self.call("GET", path)

    def events(self, path, body):
        """The JSON events of a server-sent stream, up to ``data: [DONE]`` (which must come)."""
        conn, response = self._send("POST", path, body)
        try:
            assert response.status == 200, response.read()
            while True:
                line = response.readline()
                assert line, "the stream ended without data: [DONE]"
                line = line.decode().strip()
                if line == "data: [DONE]":
                    return
                if line.startswith("data: "):
                    yield json.loads(line[len("data: ") :])
        finally:
            conn.close()


LONG = 300  # tokens of a rollout long enough to be caught mid-flight


def expected(backend, prompts, max_tokens, ignore_eos=False):
    job = json.dumps({"backend": backend, "prompts": prompts, "max_tokens": max_tokens, "ignore_eos": ignore_eos})
    result = subprocess.run(
        [sys.executable, script("serve_expected_logprobs.py")],
        input=job,
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def tokenizer():
    from hyper_gen.jobs.tokenizer import load_tokenizer

    return load_tokenizer(DEMO_MODEL_DIR)


@pytest.fixture(scope="module", params=["torch", "mindspore"])
def served(request, tokenizer):
    backend = request.param
    server = Server(serve_cmd(backend, "--max-batch-size", "8", "--served-model-name", "demo"))
    ids = [tokenizer.encode(p) for p, _ in make_prompts(3, seed=5)]
    ref = expected(backend, ids, MAX_TOKENS)
    yield backend, server, Http(server.url), ids, ref
    status = server.stop(signal.SIGTERM)
    assert status == 0, server.log
    assert "Traceback" not in server.log, server.log


def ok(reply):
    status, out = reply
    assert status == 200, out
    return out


def test_generate_token_ids_and_logprobs_equal_generate(served):
    _, _, http, ids, ref = served
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "rid": ["a", "b", "c"],
    }
    out = ok(http.post("/generate", body))
    assert isinstance(out, list) and len(out) == len(ids)
    for answer, prompt, want, rid in zip(out, ids, ref, "abc"):
        meta = answer["meta_info"]
        assert answer["output_ids"] == want["tokens"]
        assert meta["id"] == rid and meta["weight_version"] == "default"
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), len(want["tokens"]))
        ended = want["tokens"][-1] == 1
        assert meta["finish_reason"] == ({"type": "stop", "matched": 1} if ended else {"type": "length", "length": 12})
        lps = meta["output_token_logprobs"]
        assert [t for _, t, _ in lps] == want["tokens"]
        assert [lp for lp, _, _ in lps] == pytest.approx(want["logprobs"], abs=1e-4)
        tops = meta["output_top_logprobs"]
        assert all(len(top) == 2 and top[0][0] == pytest.approx(lp[0]) for top, lp in zip(tops, lps))
    single = ok(http.post("/generate", {"input_ids": ids[0], "sampling_params": {"max_new_tokens": 4}}))
    assert isinstance(single, dict) and len(single["output_ids"]) <= 4


def test_generate_structured_outputs_in_sglangs_names(served):
    """SGLang's ``json_schema`` (text) / ``regex`` / ``ebnf`` in ``sampling_params``: every answer follows
    its own grammar in one batched request."""
    _, _, http, ids, _ = served
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"]}
    schema["additionalProperties"] = False
    params = [
        {"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(schema)},
        {"max_new_tokens": 24, "temperature": 0.8, "seed": 3, "regex": "[0-9]{3} (yes|no)"},
        {"max_new_tokens": 24, "temperature": 0, "ebnf": 'root ::= "left" | "right"'},
    ]
    out = ok(http.post("/generate", {"input_ids": ids, "sampling_params": params}))
    assert json.loads(out[0]["text"])["n"] <= 99, out[0]
    assert re.fullmatch("[0-9]{3} (yes|no)", out[1]["text"]), out[1]
    assert out[2]["text"] in ("left", "right"), out[2]


def test_prompt_logprobs_from_logprob_start_len(served):
    _, _, http, ids, _ = served
    body = {"input_ids": ids[0], "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True}
    inputs = ok(http.post("/generate", dict(body, logprob_start_len=0)))["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == ids[0] and inputs[0][0] is None
    assert all(lp <= 0 for lp, _, _ in inputs[1:])
    tail = ok(http.post("/generate", dict(body, logprob_start_len=2)))["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in tail] == ids[0][2:]
    assert [lp for lp, _, _ in tail] == pytest.approx([lp for lp, _, _ in inputs[2:]], abs=1e-5)


def test_openai_return_token_ids(served, tokenizer):
    _, _, http, ids, ref = served
    body = {"model": "demo", "prompt": ids[:2], "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    out = ok(http.post("/v1/completions", body))
    assert [c["prompt_token_ids"] for c in out["choices"]] == ids[:2]
    assert [c["token_ids"] for c in out["choices"]] == [r["tokens"] for r in ref[:2]]
    events = list(http.events("/v1/completions", dict(body, prompt=ids[0], stream=True)))
    assert events[0]["choices"][0]["prompt_token_ids"] == ids[0]
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == ref[0]["tokens"]
    chat = {"model": "demo", "messages": [{"role": "user", "content": "7+5="}], "max_tokens": 6, "temperature": 0}
    templated = tokenizer.encode(
        tokenizer.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    whole = ok(http.post("/v1/chat/completions", dict(chat, return_token_ids=True)))
    assert whole["prompt_token_ids"] == templated
    generated = whole["choices"][0]["token_ids"]
    assert len(generated) == whole["usage"]["completion_tokens"]
    events = list(http.events("/v1/chat/completions", dict(chat, return_token_ids=True, stream=True)))
    assert events[0]["prompt_token_ids"] == templated
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids") or []] == generated
    plain = ok(http.post("/v1/completions", dict(body, return_token_ids=False)))
    assert plain["choices"][0]["token_ids"] is None


def test_generate_stream_n_and_text(served, tokenizer):
    _, _, http, ids, ref = served
    body = {"input_ids": ids[0], "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    events = list(http.events("/generate", dict(body, stream=True, return_logprob=True)))
    assert events[-1]["output_ids"] == ref[0]["tokens"]  # cumulative, as SGLang streams
    assert [len(e["output_ids"]) for e in events] == list(range(1, len(ref[0]["tokens"]) + 1))
    assert len(events[-1]["meta_info"]["output_token_logprobs"]) == len(ref[0]["tokens"])
    assert events[-1]["meta_info"]["finish_reason"] is not None
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    two = ok(http.post("/generate", {"input_ids": ids[1], "sampling_params": {"max_new_tokens": 4, "n": 2}}))
    assert isinstance(two, list) and len(two) == 2
    text = tokenizer.decode(ids[2], skip_special_tokens=True)
    by_text = ok(http.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}))
    assert by_text["meta_info"]["prompt_tokens"] == len(tokenizer.encode(text))


BAD = [
    ({"input_ids": [1, 2], "bogus": 1}, "bogus"),
    ({"input_ids": [1, 2], "sampling_params": {"tempreature": 0}}, "sampling_params.tempreature"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "2"}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": -7}}, "sampling_params.top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{}, {"top_p": 2}]}, "sampling_params.1.top_p"),
    ({"input_ids": [1, 100000]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1, 2], [3]], "rid": ["x"]}, "rid"),
    ({"input_ids": [1, 2], "text": "1+1="}, "input_ids"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 9}, "logprob_start_len"),
    ({"input_ids": [1, 2], "return_routed_experts": True}, "return_routed_experts"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": 3}, "sampling_params"),
    ({"input_ids": [1, 2], "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ({"input_ids": [1, 2], "sampling_params": {"regex": "(a", "ebnf": "root ::= 'a'"}}, "sampling_params.ebnf"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{}, {"regex": "(open"}]}, "sampling_params.1.regex"),
]


@pytest.mark.parametrize("body, param", BAD)
def test_bad_generate_requests_are_400s_naming_the_field(served, body, param):
    _, _, http, _, _ = served
    status, out = http.post("/generate", body)
    assert status == 400, out
    assert out["error"]["param"] == param, out


def test_bad_control_requests(served):
    _, _, http, _, _ = served
    status, out = http.post("/pause_generation", {"mode": "sideways"})
    assert status == 400 and out["error"]["param"] == "mode" and "sideways" in out["error"]["message"]
    status, out = http.post("/update_weights_from_disk", {"model_path": "/no/such/folder"})
    assert status == 400 and out["error"]["param"] == "model_path" and "/no/such/folder" in out["error"]["message"]
    assert ok(http.post("/abort_request", {"rid": "never-submitted"}))["aborted"] == 0  # SGLang ignores it
    status, out = http.post("/abort_request", {"rid": 5})
    assert status == 400 and out["error"]["param"] == "rid"
    assert ok(http.get("/get_weight_version")) == {"weight_version": "default"}


def _long_prompt(tokenizer):
    """A prompt of more than 64 tokens: a hybrid model's prefix cache hits at 64-token boundaries."""
    ids = []
    for prompt, _ in make_prompts(12, seed=11):
        ids += tokenizer.encode(prompt)
    return ids[:80]


def _stream_until(http, body, tokens: int, then):
    """Stream ``body`` from /generate; once it has ``tokens`` output ids call ``then()``; the events."""
    events, fired = [], False
    for event in http.events("/generate", dict(body, stream=True)):
        events.append(event)
        if not fired and len(event["output_ids"]) >= tokens:
            fired = True
            then()
    return events


def test_partial_rollout_abort_and_resume_equals_uninterrupted(served, tokenizer):
    backend, _, http, _, _ = served
    prompt = _long_prompt(tokenizer)
    sp = {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}
    whole = ok(http.post("/generate", {"input_ids": prompt, "sampling_params": sp}))
    assert len(whole["output_ids"]) == LONG
    assert whole["output_ids"][:24] == expected(backend, [prompt], 24, ignore_eos=True)[0]["tokens"]

    def pause_and_abort():  # deterministic: paused in place, the request holds its row; then aborted
        ok(http.post("/pause_generation", {"mode": "in_place"}))
        assert ok(http.post("/abort_request", {"rid": "rollout-1"}))["aborted"] == 1

    body = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True, "rid": "rollout-1"}
    events = _stream_until(http, body, 3, pause_and_abort)
    ok(http.post("/continue_generation"))
    last = events[-1]
    partial = last["output_ids"]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(partial) < LONG and partial == whole["output_ids"][: len(partial)]
    assert len(last["meta_info"]["output_token_logprobs"]) == len(partial)
    assert last["meta_info"]["weight_version"] == "default"
    rest = dict(sp, max_new_tokens=LONG - len(partial))
    resumed = ok(http.post("/generate", {"input_ids": prompt + partial, "sampling_params": rest}))
    assert partial + resumed["output_ids"] == whole["output_ids"]
    assert resumed["meta_info"]["cached_tokens"] >= 64  # the prefix cache served the rollout so far

    # pause in abort mode ends it the same way; a weight update before the resubmission: recomputed, versioned
    body["rid"] = "rollout-2"
    events = _stream_until(http, body, 3, lambda: ok(http.post("/pause_generation", {"mode": "abort"})))
    partial = events[-1]["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort" and len(partial) >= 3
    out = ok(http.post("/update_weights_from_disk", {"model_path": DEMO_MODEL_DIR, "weight_version": "v1"}))
    assert out["success"], out
    ok(http.post("/continue_generation"))
    assert ok(http.get("/get_weight_version")) == {"weight_version": "v1"}
    rest = dict(sp, max_new_tokens=LONG - len(partial))
    resumed = ok(http.post("/generate", {"input_ids": prompt + partial, "sampling_params": rest}))
    assert resumed["meta_info"]["weight_version"] == "v1"
    assert resumed["meta_info"]["cached_tokens"] == 0  # the update reset the prefix cache
    assert partial + resumed["output_ids"] == whole["output_ids"]  # the same weights, reloaded


def test_flush_cache_and_memory_occupation(served, tokenizer):
    _, _, http, ids, ref = served
    prompt = _long_prompt(tokenizer)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    ok(http.post("/generate", body))
    assert ok(http.post("/generate", body))["meta_info"]["cached_tokens"] >= 64
    assert ok(http.post("/flush_cache"))["success"]
    assert ok(http.post("/generate", body))["meta_info"]["cached_tokens"] == 0
    ok(http.get("/flush_cache"))

    busy = {"input_ids": prompt, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}, "rid": "busy"}
    done = {}
    ok(http.post("/pause_generation", {"mode": "in_place"}))
    thread = threading.Thread(target=lambda: done.update(out=http.post("/generate", busy)))
    thread.start()
    for _ in range(200):  # queued behind the pause
        status, load = http.get("/health")
        assert status == 503 and load["status"] == "paused", load  # a router sends requests elsewhere meanwhile
        if load["waiting"] + load["running"]:
            break
        time.sleep(0.05)
    status, out = http.post("/flush_cache")
    assert status == 400 and "running or queued" in out["error"]["message"], out
    ok(http.post("/abort_request", {"abort_all": True}))
    ok(http.post("/continue_generation"))
    thread.join(60)
    assert ok(done["out"])["meta_info"]["finish_reason"]["type"] == "abort"

    ok(http.post("/release_memory_occupation"))
    status, out = http.post("/generate", body)
    assert status == 503, out
    ok(http.post("/resume_memory_occupation"))
    again = ok(
        http.post(
            "/generate", {"input_ids": ids[0], "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
        )
    )
    assert again["output_ids"] == ref[0]["tokens"]
