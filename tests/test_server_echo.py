"""What an evaluation harness needs of ``hyper-gen serve``, on both backends: ``echo`` on
``/v1/completions`` (vLLM's: the prompt's text and tokens' logprobs first, equal to ``score()``),
one logprobs entry per counted token (the EOS that ended a choice included, as ``""``), vLLM's
``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (through lm-evaluation-harness' own remote
tokenizer too), an access line per request (none with ``-q``), and a 400 naming the field for
what these take wrong.

Each backend's server is a real ``python -m hyper_gen serve --port 0`` process; the reference
logprobs are ``hyper_gen.score`` on the same checkpoint in the test process.
"""

import json
import re
import time

import pytest
from demo_task import DEMO_MODEL_DIR
from test_server import Server, post, serve_cmd

PROMPT = "rev 12345 ="  # the demo model answers " 54321" then EOS
ANSWERED = "rev 12345 = 54321"  # ... whose next token is the EOS


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module", params=["torch", pytest.param("mindspore", marks=pytest.mark.slow)])
def served(request):
    """(backend, server) per backend (MindSpore's: its graph compiles make each case 6 s or more on 2 cores)."""
    server = Server(serve_cmd(request.param, "--served-model-name", "demo"))
    yield request.param, server
    server.stop()


def _score(backend, ids):
    """``hyper_gen.score`` of one row on the backend's demo model: [0.0, logp(ids[1] | ids[:1]), ...]."""
    import numpy as np

    from hyper_gen import load_model, score
    from hyper_gen.registry import to_host

    model = _models.get(backend) or _models.setdefault(backend, load_model(DEMO_MODEL_DIR, backend=backend))
    return np.asarray(to_host(score(model, [ids])))[0].tolist()


_models = {}


def test_echo_logprobs_are_the_prompt_scores(served, tokenizer):
    backend, server = served
    client = server.client()
    rows = [tokenizer.encode(ANSWERED), tokenizer.encode("rev 907 = 7")]
    # lm-eval's loglikelihood request: token ids, batched, one token generated, the prompt echoed
    out = client.completions.create(model="demo", prompt=rows, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    for ids, choice in zip(rows, out.choices):
        lp = choice.logprobs
        assert choice.text.startswith(tokenizer.decode(ids))
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(_score(backend, ids)[1:], abs=1e-4)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert len(top) == 1 and max(top.values()) >= value  # equal where the token is the likeliest
            assert (token in top) == (top.get(token) == value)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].logprobs.tokens[-1] == ""  # the EOS' entry

    # max_tokens 0: the prompt scored, nothing generated or counted
    only = client.completions.create(model="demo", prompt=rows, max_tokens=0, logprobs=2, echo=True)
    for ids, choice, full in zip(rows, only.choices, out.choices):
        assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
        # (abs 1e-4 as against score(): a row's float32 values move with what shares its forward, issue 45)
        assert choice.logprobs.token_logprobs == pytest.approx(full.logprobs.token_logprobs[: len(ids)], abs=1e-4)
        assert all(top is None or len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (sum(map(len, rows)), 0)


def test_echo_puts_the_prompt_before_the_completion(served):
    _, server = served
    client = server.client()
    ask = dict(model="demo", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    plain = client.completions.create(**ask).choices[0]
    echoed = client.completions.create(**ask, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text == ANSWERED
    tail = len(echoed.logprobs.tokens) - len(plain.logprobs.tokens)
    assert echoed.logprobs.tokens[tail:] == plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[tail:] == plain.logprobs.token_logprobs
    assert echoed.logprobs.text_offset[tail:] == [len(PROMPT) + o for o in plain.logprobs.text_offset]
    text_only = client.completions.create(model="demo", prompt=[PROMPT, "rev 1 ="], max_tokens=8, echo=True)
    assert text_only.choices[0].text == ANSWERED and text_only.choices[0].logprobs is None
    assert text_only.choices[1].text.startswith("rev 1 =")


def test_the_eos_has_a_logprobs_entry(served):
    _, server = served
    client = server.client()
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    lp = out.choices[0].logprobs
    assert (out.choices[0].text, out.choices[0].finish_reason) == (" 54321", "stop")
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == 7
    assert lp.tokens[-1] == "" and lp.text_offset[-1] == 6 and lp.token_logprobs[-1] <= 0
    # a choice that ends on its first token: that token's entry
    one = client.completions.create(model="demo", prompt=ANSWERED, max_tokens=1, temperature=0, logprobs=1)
    assert one.choices[0].finish_reason == "stop" and one.usage.completion_tokens == 1
    assert one.choices[0].logprobs.tokens == [""] and len(one.choices[0].logprobs.token_logprobs) == 1
    # streamed: the same entries
    chunks = list(
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1, stream=True)
    )
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    # chat alike
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0, logprobs=True
    )
    content = chat.choices[0].logprobs.content
    assert (
        len(content) == chat.usage.completion_tokens
        and "".join(t.token for t in content) == chat.choices[0].message.content
    )
    if chat.choices[0].finish_reason == "stop":
        assert content[-1].token == "" and content[-1].bytes == []


def test_tokenize_and_detokenize(served, tokenizer):
    import requests

    _, server = served
    url = server.url
    text = "rev 12 = 21"
    got = requests.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    want = tokenizer.encode(text, add_special_tokens=False)
    assert got == {"count": len(want), "max_model_len": got["max_model_len"], "tokens": want}
    assert got["max_model_len"] == server.client().models.retrieve("demo").max_model_len
    got = requests.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer.encode(text) and got["token_strs"] == tokenizer.convert_ids_to_tokens(
        got["tokens"]
    )
    messages = [{"role": "user", "content": text}]
    got = requests.post(url + "/tokenize", json={"model": "demo", "messages": messages}).json()
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got["tokens"] == tokenizer.encode(templated, add_special_tokens=False)
    ids = tokenizer.encode(text)
    assert requests.post(url + "/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    info = requests.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template

    # lm-evaluation-harness' own remote tokenizer (what its local-completions picks when these answer)
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(url + "/v1/completions")
    remote = RemoteTokenizer(url + "/v1/completions")
    assert remote.encode(text) == want and remote.decode(want) == tokenizer.decode(want)
    assert remote.eos_token_id == tokenizer.eos_token_id


BAD = [
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "stream": True}, 400, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "min_tokens": 1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "echo": "yes"}, 400, "echo"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{p}:{n}" for p, _, _, n in BAD])
def test_bad_input_is_an_error_naming_the_field(served, path, body, status, param):
    _, server = served
    got, text = post(server.url + path, json.dumps(body))
    assert (got, json.loads(text)["error"]["param"]) == (status, param), text


def test_each_request_is_logged(served):
    _, server = served
    post(server.url + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 0}))
    post(server.url + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}))
    line = r'hyper-gen serve: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d 127\.0\.0\.1:\d+ "POST /v1/completions" %d \d+\.\d ms'
    deadline = time.time() + 10  # the line is written as the response ends, and read on another thread
    while time.time() < deadline and not (re.search(line % 400, server.log) and re.search(line % 200, server.log)):
        time.sleep(0.05)
    assert re.search(line % 400, server.log) and re.search(line % 200, server.log), server.log


@pytest.mark.slow  # a server subprocess of its own, started and signalled
def test_quiet_logs_no_requests():
    """``-q``: no access lines (the log is the server's, not the backend's: torch's server shows it)."""
    server = Server(serve_cmd("torch", "-q"))
    try:
        assert post(server.url + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 0}))[0] == 400
        assert post(server.url + "/tokenize", json.dumps({"prompt": PROMPT}))[0] == 200
    finally:
        assert server.stop() == 0
    assert "/v1/completions" not in server.log and "/tokenize" not in server.log, server.log
