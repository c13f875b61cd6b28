"""Ranks that must agree, ranks that stall, people who pause, threads and native memory.

- seed=None sampling with a different RNG state per rank: every rank ends with rank 0's tokens;
- a logits_processor / stopping_criteria on one rank only: the same ValueError naming the field;
- a stalled (SIGSTOPped) rank: the job fails within the configured timeout, the timeout named;
- ``hyper-gen chat`` under torchrun: a pause longer than ``--timeout`` is not a stalled rank;
- MindSpore ``generate`` from 4 threads: serialised, every result the single-threaded one;
- (MindSpore native memory: tests/test_memory_soak.py.)

Multi-process jobs run in their own session (killed whole on timeout: a SIGSTOPped worker would
otherwise outlive the test) on free ports.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
from launch import REPO, _env, free_port, msrun, script, torchrun

from hyper_gen.parallel import launcher
from hyper_gen.parallel.model_group import check_consistent_inputs


def _kill_tree(proc):
    """SIGKILL ``proc`` and every process below it: launchers start their workers in sessions of
    their own, and a SIGSTOPped worker outlives its launcher's group (SIGKILL ends it stopped too)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    os.killpg(proc.pid, signal.SIGKILL)
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def _run_session(cmd, timeout, env=None, feed=None, until=None):
    """(returncode, output, seconds) of ``cmd`` in a new session, killed as a whole after ``timeout``.
    ``feed(proc, output)`` may drive stdin while ``output`` (a list of str chunks) fills; once
    ``until(output)`` is true the job has said what the test reads, and it is killed then."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env or _env(),
        cwd=REPO,
        start_new_session=True,
    )
    output = []

    def pump():
        for chunk in iter(lambda: os.read(proc.stdout.fileno(), 4096), b""):
            output.append(chunk.decode("utf-8", "replace"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if feed is not None:
            feed(proc, output)
        else:
            proc.stdin.close()
        while until is not None and proc.poll() is None and time.monotonic() - start < timeout:
            if until(output):
                break
            time.sleep(0.2)
        else:
            proc.wait(timeout=max(1, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            _kill_tree(proc)  # the whole job, stopped workers too
        reader.join(timeout=10)
    return proc.returncode, "".join(output), time.monotonic() - start


def _torchrun_cmd(nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]


# ------------------------------------------------------------------ 1 + 2: ranks that must agree


def _check_agreement(text):
    tokens = dict(re.findall(r"rank (\d): unseeded tokens=(\[\[.*?\]\])", text))
    assert set(tokens) == {"0", "1"}, text[-3000:]
    assert tokens["0"] == tokens["1"], f"ranks drew different tokens: {tokens}"
    for field in ("logits_processor", "stopping_criteria", "different logits_processor"):
        for rank in ("0", "1"):
            pattern = rf"rank {rank}: one-rank {field}: ValueError: generate\(\) was called with different (\w+)"
            found = re.search(pattern, text)
            assert found, f"rank {rank}, {field} on one rank:\n{text[-3000:]}"
            assert found.group(1) == field.split()[-1], found.group(0)
    streamed = dict(re.findall(r"rank (\d): rank-0 streamer tokens=(\[\[.*?\]\])", text))
    assert set(streamed) == {"0", "1"} and streamed["0"] == streamed["1"], text[-3000:]


@pytest.mark.distributed
def test_torchrun_ranks_agree_on_unseeded_tokens_and_one_rank_callables_are_named():
    result = torchrun([script("rank_agreement.py"), "torch"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check_agreement(result.stdout)


@pytest.mark.distributed
def test_msrun_ranks_agree_on_unseeded_tokens_and_one_rank_callables_are_named(tmp_path):
    result = msrun([script("rank_agreement.py"), "mindspore"], log_dir=str(tmp_path), timeout=300)
    assert result.returncode == 0, result.worker_logs[-4000:]
    _check_agreement(result.worker_logs)


class _TwoRankOps:
    """Rank 0 of a fake 2-rank group whose other rank fingerprints ``peer`` (prompt, config)."""

    def __init__(self, peer):
        self.peer = peer

    def world_size(self, group=None):
        return 2

    def asarray(self, array, dtype=None):
        return np.asarray(array)

    def to_numpy(self, x):
        return np.asarray(x)

    def all_gather(self, x, axis=0, group=None):
        from hyper_gen.parallel.model_group import _fingerprint

        return np.concatenate([x, _fingerprint(*self.peer)[1]], axis=0)


def test_consistency_check_names_each_differing_field():
    from hyper_gen import GenerationConfig
    from hyper_gen.inputs import prepare_prompts

    model = type("M", (), {"parallel_group": None})()
    prompt = prepare_prompts([[5, 6, 7]], None)
    mine = GenerationConfig(max_new_tokens=4)
    check_consistent_inputs(_TwoRankOps((prompt, mine)), model, prompt, mine)  # the same: no error
    cases = [
        (prompt, mine.replace(logits_processor=[lambda ids, scores: scores]), "logits_processor"),
        (prompt, mine.replace(stopping_criteria=[lambda ids, scores: False]), "stopping_criteria"),
        (prepare_prompts([[5, 6, 8]], None), mine, "input_ids"),
        (prompt, mine.replace(top_k=7), "top_k"),
    ]
    for peer_prompt, peer_config, field in cases:
        with pytest.raises(ValueError, match=rf"different {field} on rank\(s\) \[1\]"):
            check_consistent_inputs(_TwoRankOps((peer_prompt, peer_config)), model, prompt, mine)


# ------------------------------------------------------------------ 3: a stalled rank


def test_timeout_option_is_checked(monkeypatch):
    monkeypatch.delenv(launcher.TIMEOUT_ENV, raising=False)
    assert launcher.collective_timeout_s() is None
    assert launcher.collective_timeout_s(7) == 7.0
    monkeypatch.setenv(launcher.TIMEOUT_ENV, "12.5")
    assert launcher.collective_timeout_s() == 12.5 and launcher.collective_timeout_s(3) == 3.0
    for bad in (0, -1, "soon", float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="timeout_s must be a positive number"):
            launcher.collective_timeout_s(bad)
    monkeypatch.setenv(launcher.TIMEOUT_ENV, "0")
    with pytest.raises(ValueError, match=launcher.TIMEOUT_ENV):
        launcher.collective_timeout_s()


def test_cli_timeout_flag_is_documented_and_checked():
    env = _env()
    run = [sys.executable, "-m", "hyper_gen", "generate"]
    shown = subprocess.run(run + ["--help"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert "--timeout SECONDS" in shown.stdout and "HYPER_GEN_TIMEOUT_S" in shown.stdout, shown.stdout
    bad = subprocess.run(
        run + ["--prompt", "rev 1 =", "--timeout", "0"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert bad.returncode == 2 and "--timeout must be a positive number" in bad.stderr, bad.stderr[-2000:]


TIMEOUT_S = 5


STALL = re.compile(r"rank 0: (\w+) after ([\d.]+) s: (.*)\n")  # rank 0's report of the stall, a whole line


def _check_stall(code, text, seconds, named):
    found = STALL.search(text)
    assert found, f"rank 0 never reported the stall ({seconds:.0f} s, exit {code}):\n{text[-3000:]}"
    kind, waited, message = found.group(1), float(found.group(2)), found.group(3)
    assert kind == "TimeoutError" and named in message, found.group(0)
    assert TIMEOUT_S - 0.5 <= waited <= 3 * TIMEOUT_S, f"rank 0 waited {waited} s for a {TIMEOUT_S} s timeout"


@pytest.mark.distributed
def test_torchrun_stalled_rank_fails_within_the_timeout():
    env = dict(_env(), HYPER_GEN_TIMEOUT_S=str(TIMEOUT_S))
    cmd = _torchrun_cmd(2) + [script("stalled_rank.py"), "torch"]
    code, text, seconds = _run_session(cmd, timeout=150, env=env, until=lambda output: STALL.search("".join(output)))
    _check_stall(code, text, seconds, f"{TIMEOUT_S} s (timeout_s= / --timeout / $HYPER_GEN_TIMEOUT_S")
    assert seconds < 120  # the old default was 600 s (the job is killed once rank 0 has reported)


@pytest.mark.distributed
def test_msrun_stalled_rank_fails_within_the_timeout(tmp_path):
    cmd = [
        "msrun",
        "--worker_num=2",
        "--local_worker_num=2",
        f"--master_port={free_port()}",
        "--join=True",
        f"--log_dir={tmp_path}",
        script("stalled_rank.py"),
        "mindspore",
    ]
    env = dict(_env(), HYPER_GEN_TIMEOUT_S=str(TIMEOUT_S))

    def logs(output=None):
        names = sorted(os.listdir(tmp_path)) if tmp_path.exists() else []
        return "".join(open(tmp_path / name, errors="replace").read() for name in names if name.startswith("worker_"))

    code, text, seconds = _run_session(cmd, timeout=180, env=env, until=lambda output: STALL.search(logs()))
    _check_stall(code, logs(), seconds, f"MS_CPU_COMM_OP_TIMEOUT={TIMEOUT_S} s")


# ------------------------------------------------------------------ 4: a person is not a stalled rank


@pytest.mark.distributed
def test_torchrun_chat_pause_longer_than_the_timeout():
    from demo_task import is_correct, make_prompts

    prompts = [p for p, _ in make_prompts(2, seed=11)]
    pause = 2 * TIMEOUT_S

    def feed(proc, output):
        proc.stdin.write((prompts[0] + "\n").encode())
        proc.stdin.flush()
        deadline = time.monotonic() + 150
        while "".join(output).count("User:") < 2:  # the first reply is out, rank 0 waits for stdin
            assert time.monotonic() < deadline and proc.poll() is None, "".join(output)[-3000:]
            time.sleep(0.2)
        time.sleep(pause)  # the user thinks, two timeouts long
        try:
            proc.stdin.write((prompts[1] + "\n").encode())
            proc.stdin.close()
        except BrokenPipeError:  # the job died while the user thought: reported below
            pass

    cmd = _torchrun_cmd(2) + ["-m", "hyper_gen", "chat", "--tp", "2", "--timeout", str(TIMEOUT_S)]
    code, text, seconds = _run_session(cmd + ["--max-new-tokens", "12"], timeout=240, feed=feed)
    assert code == 0, text[-3000:]
    replies = [part.split("User:")[0].strip() for part in text.split("Assistant:")[1:]]
    assert len(replies) == 2, text[-3000:]
    for prompt, reply in zip(prompts, replies):
        assert is_correct(prompt, " " + reply), (prompt, reply)


def test_patient_broadcast_reads_directly_on_one_process():
    class One:
        def world_size(self, group=None):
            return 1

    assert launcher.broadcast_text_patiently(One(), lambda: "hi") == "hi"
    assert launcher.heartbeat_s(None) == 1.0 and launcher.heartbeat_s(2) == 0.5 and launcher.heartbeat_s(0.01) == 0.05


# ------------------------------------------------------------------ 5 + 6: MindSpore threads and memory

THREADS_JOB = r"""
import sys, threading
import numpy as np
import hyper_gen
from hyper_gen.demo import demo_model_path
from hyper_gen.registry import to_host

backend = sys.argv[1]
model = hyper_gen.load_model(demo_model_path(), backend=backend)
other = hyper_gen.load_model(demo_model_path(), backend=backend)  # a second model: the same runtime
ids, mask = [[5, 6, 7, 8, 9, 10], [0, 0, 7, 8, 9, 4]], [[1] * 6, [0, 0, 1, 1, 1, 1]]
config = hyper_gen.GenerationConfig(max_new_tokens=16, eos_token_id=None)
expected = np.asarray(to_host(hyper_gen.generate(model, ids, config, attention_mask=mask)))
results, errors = [], []

def work(i):
    try:
        for _ in range(3):
            out = hyper_gen.generate(model if i % 2 else other, ids, config, attention_mask=mask)
            results.append(np.asarray(to_host(out)))
    except Exception as error:
        errors.append(repr(error))

threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
same = sum(np.array_equal(r, expected) for r in results)
print(f"results={len(results)} same={same} errors={errors}", flush=True)
"""


@pytest.mark.parametrize("backend", ["mindspore", "torch"])
def test_generate_from_four_threads(backend):
    result = subprocess.run(
        [sys.executable, "-c", THREADS_JOB, backend], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300
    )
    assert result.returncode == 0, f"exit {result.returncode} (a segfault is -11):\n{result.stderr[-3000:]}"
    assert "results=12 same=12 errors=[]" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]


# MindSpore native memory over many calls: tests/test_memory_soak.py (generate and the engine, both frameworks)
