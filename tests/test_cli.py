"""The CLI: generate (both backends), errors, chat, in this process (tests/cli_runner.py); as real processes
where the boundary is the point: the console script, a job killed halfway and resumed, distributed chat."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from demo_task import is_correct, make_prompts
from launch import REPO, _env, msrun, torchrun

CLI = [sys.executable, "-m", "hyper_gen"]


def run_cli(args, stdin=None, timeout=180):
    return subprocess.run(
        CLI + list(args), input=stdin, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO
    )


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_generate_prompts_on_demo_model(backend, cli):
    prompts = make_prompts(4, seed=7)
    args = ["generate", "--backend", backend, "--max-new-tokens", "12"]
    for prompt, _ in prompts:
        args += ["--prompt", prompt]
    result = cli(args)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == len(prompts)
    for (prompt, _), line in zip(prompts, lines):
        assert line.startswith(prompt) and is_correct(prompt, line[len(prompt) :])


def test_stream_and_sampling_flags(cli):
    prompt, _ = make_prompts(1, seed=3)[0]
    result = cli(
        [
            "generate",
            "--prompt",
            prompt,
            "--stream",
            "--do-sample",
            "--temperature",
            "0.5",
            "--top-k",
            "5",
            "--top-p",
            "0.9",
            "--seed",
            "1",
            "--max-new-tokens",
            "12",
        ]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(prompt) and is_correct(prompt, result.stdout[len(prompt) :].rstrip("\n"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt", "x", "--backend", "jax"], "unknown backend 'jax'"),
        (["generate", "--prompt", "x", "--model", "/"], "not an HF checkpoint"),
        (["generate", "--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    ],
)
def test_errors_are_one_line_exit_2(args, message, cli):
    result = cli(args)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_missing_tokenizer_exit_2(tmp_path, cli):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    result = cli(["generate", "--prompt", "x", "--model", str(tmp_path)])
    assert result.returncode == 2 and "no tokenizer" in result.stderr


def test_the_console_script_exits_2_with_one_line():
    """The installed ``hyper-gen`` script, a real process: its exit status and stderr, not main's return value."""
    script = shutil.which("hyper-gen")
    assert script, "the hyper-gen console script is not installed (pip install -e .)"
    result = subprocess.run(
        [script, "generate", "--prompt", "x", "--top-p", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=REPO,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyper-gen: error: ") and "top_p must be in (0, 1]" in lines[0]
    version = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60, env=_env(), cwd=REPO)
    assert version.returncode == 0 and version.stdout.startswith("hyper-gen ")


def _write_prompts(path, n):
    prompts = make_prompts(n, seed=11)
    with open(path, "w") as f:
        for i, (prompt, _) in enumerate(prompts):
            f.write(json.dumps({"id": f"row-{i}", "prompt": prompt}) + "\n")
            if i == 3:
                f.write("{this is not json\n")
            if i == 5:
                f.write(json.dumps({"prompt": "no id"}) + "\n")
    return {f"row-{i}": p for i, (p, _) in enumerate(prompts)}


def test_jsonl_killed_halfway_then_resumed(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    expected = _write_prompts(inp, 24)
    args = CLI + ["generate", "--input", str(inp), "--output", str(out), "--batch-size", "1", "--max-new-tokens", "12"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = out.read_text().splitlines()
    assert 5 <= len(written) < 24, "the job was not interrupted halfway"
    with open(out, "a") as f:  # a kill in the middle of a write leaves a partial line
        f.write('{"id": "row-half", "prom')
    result = subprocess.run(args, capture_output=True, text=True, timeout=180, env=_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [row["id"] for row in rows]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids))  # nothing lost, nothing twice
    for row in rows:
        assert row["prompt"] == expected[row["id"]] and is_correct(row["prompt"], row["completion"])
        assert row["finish_reason"] == "stop" and row["completion_tokens"] > 0
    assert f"{inp}:5: skipped malformed line" in result.stderr  # the broken JSON line
    assert f"{inp}:8: skipped malformed line" in result.stderr  # the line without an id


def test_chat_single_process_keeps_conversation(cli):
    (p1, _), (p2, _) = make_prompts(2, seed=5)
    result = cli(["chat", "--max-new-tokens", "12"], stdin=f"{p1}\n{p2}\nexit\n")
    assert result.returncode == 0, result.stderr[-2000:]
    replies = [part.split("User:")[0].strip() for part in result.stdout.split("Assistant:")[1:]]
    assert len(replies) == 2 and is_correct(p1, " " + replies[0]) and is_correct(p2, " " + replies[1])


def _check_chat(text, prompts):
    assert text.count("Entering chat") == 1, text[-3000:]
    replies = [part.split("User:")[0].strip() for part in text.split("Assistant:")[1:]]
    assert len(replies) == len(prompts), text[-3000:]
    for prompt, reply in zip(prompts, replies):
        assert is_correct(prompt, " " + reply), (prompt, reply)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", ["1", "2"])
def test_chat_under_torchrun_two_ranks(tp):
    prompts = [p for p, _ in make_prompts(2, seed=9)]
    result = torchrun(
        [
            "-m",
            "hyper_gen",
            "chat",
            "--tp",
            tp,
            "--max-new-tokens",
            "12",
            "--do-sample",
            "--temperature",
            "0.3",
            "--seed",
            "4",
        ],
        stdin="\n".join(prompts) + "\n",
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    _check_chat(result.stdout, prompts)  # EOF quits; rank 1 printed nothing


@pytest.mark.distributed
def test_chat_under_msrun_two_ranks_tp2(tmp_path):
    prompts = [p for p, _ in make_prompts(2, seed=10)]
    main_py = os.path.join(REPO, "hyper_gen", "__main__.py")
    result = msrun(
        [main_py, "chat", "--backend", "mindspore", "--tp", "2", "--max-new-tokens", "12"],
        log_dir=str(tmp_path),
        stdin="\n".join(prompts) + "\nexit\n",
        timeout=300,
    )
    assert result.returncode == 0, result.worker_logs[-3000:]
    logs = {name: open(tmp_path / name).read() for name in os.listdir(tmp_path) if name.startswith("worker_")}
    assert "Assistant:" in logs["worker_0.log"] and "Assistant:" not in logs["worker_1.log"]
    _check_chat(logs["worker_0.log"], prompts)


@pytest.mark.distributed
def test_generate_tp2_under_torchrun():
    prompts = [p for p, _ in make_prompts(3, seed=12)]
    args = ["-m", "hyper_gen", "generate", "--tp", "2", "--max-new-tokens", "12"]
    for prompt in prompts:
        args += ["--prompt", prompt]
    result = torchrun(args, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("rev")]
    assert len(lines) == len(prompts)  # printed once, by rank 0
    for prompt, line in zip(prompts, lines):
        assert is_correct(prompt, line[len(prompt) :])
