"""A fleet of ``hyper-gen serve`` workers behind SGLang's and vLLM's routers, as RL frameworks run them.

A torch worker and a MindSpore worker (real ``python -m hyper_gen serve`` processes on the demo
model, 127.0.0.1, free ports) behind sglang-router (``cache_aware``) and vllm-router
(``round_robin``), both real router processes from the package index. Completions and chat go
through the official ``openai`` client, ``/generate`` as raw HTTP, as the routers' clients send
them; every answer must equal the worker's direct answer and plain ``generate()``'s tokens, and
both workers must serve. Then one worker is killed (SIGKILL) mid-run: every request sent after
that answers correctly through each router (started with ``--cb-failure-threshold 1``, as the
README's scale-out section advises, so a dead worker is skipped at its first failure).
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from demo_task import make_prompts
from launch import REPO, _env, free_port
from test_server import Server, expected, serve_cmd
from test_server_sglang import Http

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MAX_TOKENS = 10
ROUTERS = {
    "sglang": ("sglang_router.launch_router", "cache_aware"),
    "vllm": ("vllm_router.launch_router", "round_robin"),
}


class Router:
    """A router process in front of ``urls``; ``url`` once it routes a request to a worker."""

    def __init__(self, kind: str, urls, timeout_s: float = 120):
        module, policy = ROUTERS[kind]
        self.kind, self.port = kind, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--worker-urls", *urls, "--policy", policy, "--log-level", "warning" if kind == "vllm" else "warn"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # each its own
        if policy == "cache_aware":  # a prompt matching under half of a worker's prefix is a miss ("rev " is 40%)
            cmd += ["--cache-threshold", "0.5"]
        # a worker that fails once is skipped (its circuit opens) and the request retried on another: with
        # the default (10 failures) the first requests after a worker dies can fail on it, all retries included
        cmd += ["--cb-failure-threshold", "1"]
        self.log_path = os.path.join(REPO, ".pytest_cache", f"router-{kind}-{self.port}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        body = {"model": "demo", "prompt": "rev 1 =", "max_tokens": 1, "temperature": 0}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.text()
            try:
                if Http(self.url).post("/v1/completions", body)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"{kind} router did not route a request:\n" + self.text())

    def text(self) -> str:
        self.log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def tokenizer():
    from hyper_gen.demo import demo_model_path
    from hyper_gen.jobs.tokenizer import load_tokenizer

    return load_tokenizer(demo_model_path())


PROMPTS = [prompt for prompt, _ in make_prompts(6, seed=11)]


@pytest.fixture(scope="module")
def fleet(tokenizer):
    """{backend: worker}, {router kind: Router} and the reference answers."""
    workers = {}
    routers = {}
    try:
        for backend in ("torch", "mindspore"):
            workers[backend] = Server(serve_cmd(backend, "--max-batch-size", "8", "--served-model-name", "demo"))
        urls = [w.url for w in workers.values()]
        for kind in ROUTERS:
            routers[kind] = Router(kind, urls)
        ids = [tokenizer.encode(p) for p in PROMPTS]
        chat_ids = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for p in PROMPTS
        ]
        tokens = {backend: expected(backend, ids + chat_ids, MAX_TOKENS) for backend in workers}
        assert tokens["torch"] == tokens["mindspore"]  # greedy: the same tokens whichever backend serves
        greedy = tokens["torch"]
        reference = {
            "ids": ids,
            "completion_tokens": greedy[: len(ids)],
            "completion": [tokenizer.decode(t, skip_special_tokens=True) for t in greedy[: len(ids)]],
            "chat": [tokenizer.decode(t, skip_special_tokens=True) for t in greedy[len(ids) :]],
        }
        yield workers, routers, reference
    finally:
        for router in routers.values():
            router.stop()
        for worker in workers.values():
            if worker.proc.poll() is None:
                assert worker.stop(signal.SIGTERM) == 0, worker.log
            assert "Traceback" not in worker.log and "Invalid HTTP request" not in worker.log, worker.log


def prompt_tokens_seen(worker) -> float:
    """The prompt tokens the worker has looked up in its prefix cache: grows with every request it serves."""
    with urllib.request.urlopen(worker.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    match = re.search(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M)
    return float(match.group(1))


def ask(target_url: str, client: openai.OpenAI, i: int) -> dict:
    """Prompt i's completion, chat reply (streamed) and /generate answer from ``target_url``."""
    prompt = PROMPTS[i]
    completion = client.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    chat = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    status, native = Http(target_url).post(
        "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    )
    assert status == 200, native
    return {
        "completion": completion.choices[0].text,
        "finish": completion.choices[0].finish_reason,
        "usage": (completion.usage.prompt_tokens, completion.usage.completion_tokens),
        "chat": chat,
        "output_ids": native["output_ids"],
        "text": native["text"],
    }


def check(answer: dict, reference: dict, i: int) -> None:
    assert answer["completion"] == reference["completion"][i], (i, answer)
    assert answer["chat"] == reference["chat"][i], (i, answer)
    assert answer["output_ids"] == reference["completion_tokens"][i], (i, answer)
    assert answer["text"] == reference["completion"][i], (i, answer)
    assert answer["usage"] == (len(reference["ids"][i]), len(reference["completion_tokens"][i])), (i, answer)


@pytest.mark.parametrize("kind", sorted(ROUTERS))
def test_answers_through_the_router_equal_direct_answers_and_generate(fleet, kind):
    workers, routers, reference = fleet
    router = routers[kind]
    before = {backend: prompt_tokens_seen(w) for backend, w in workers.items()}
    # all prompts at once, as a rollout sends them: cache_aware gives a prompt that matches no
    # worker's prefixes to the least loaded worker, so overlapping requests spread over the fleet
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        routed = list(pool.map(lambda i: ask(router.url, router.client(), i), range(len(PROMPTS))))
    for i, answer in enumerate(routed):
        check(answer, reference, i)
        for worker in workers.values():  # the worker's own answer, field by field
            assert answer == ask(worker.url, worker.client(), i), (i, worker.url)
    grew = {backend: prompt_tokens_seen(w) - before[backend] for backend, w in workers.items()}
    assert all(n > 0 for n in grew.values()), (grew, router.text())  # both workers served


def test_a_worker_killed_mid_run_leaves_every_later_request_answered(fleet):
    workers, routers, reference = fleet
    killed_at = []  # when the worker was gone
    results = {kind: [] for kind in routers}
    stop = threading.Event()

    def load(kind):
        router, i = routers[kind], 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                results[kind].append((started, i, ask(router.url, router.client(), i % len(PROMPTS)), None))
            except Exception as exc:  # a request caught by the kill may fail; none sent after it may
                results[kind].append((started, i, None, exc))
            i += 1

    threads = [threading.Thread(target=load, args=(kind,)) for kind in routers]
    for thread in threads:
        thread.start()
    time.sleep(3)  # mid-run
    victim = workers["mindspore"]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(30)
    killed_at.append(time.monotonic())
    time.sleep(8)
    stop.set()
    for thread in threads:
        thread.join(180)
    for kind, done in results.items():
        later = [(i, answer, exc) for started, i, answer, exc in done if started > killed_at[0]]
        assert len(later) >= 3, (kind, done)
        for i, answer, exc in later:
            assert exc is None, (kind, i, exc, routers[kind].text()[-3000:])
            check(answer, reference, i % len(PROMPTS))
    # and once the kill is long past, each router still answers every endpoint
    for router in routers.values():
        for i in range(3):
            check(ask(router.url, router.client(), i), reference, i)
