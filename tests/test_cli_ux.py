"""The CLI as a new user meets it: --version, defaults in --help, vLLM-style temperature, one-line
errors for what they type, quiet framework logs, a chat that survives blank and overlong lines.

Run in this process (tests/cli_runner.py) except where the process is the point: MindSpore reads its
log level when it is first imported, and Ctrl-C is a signal."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from demo_task import DEMO_MODEL_DIR, is_correct
from launch import REPO, _env

from hyper_gen import __version__

CLI = [sys.executable, "-m", "hyper_gen"]


def run_cli(args, stdin=None, timeout=180, env=None):
    return subprocess.run(
        CLI + list(args), input=stdin, capture_output=True, text=True, timeout=timeout, env=env or _env(), cwd=REPO
    )


def _one_line_error(result, *needles):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_version(cli):
    result = cli(["--version"])
    assert result.returncode == 0 and result.stdout.strip() == f"hyper-gen {__version__}"


def test_help_shows_defaults(cli):
    result = cli(["generate", "--help"])
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for shown in ("(default: 64)", "(default: torch)", "(default: 8)", "0 = greedy"):
        assert shown in text, shown


def test_temperature_zero_is_greedy_and_equals_the_default(cli):
    greedy = cli(["generate", "--prompt", "rev 4711 =", "--max-new-tokens", "12"])
    zero = cli(["generate", "--prompt", "rev 4711 =", "--max-new-tokens", "12", "--temperature", "0"])
    assert greedy.returncode == 0 and zero.returncode == 0, zero.stderr[-2000:]
    assert zero.stdout == greedy.stdout and is_correct("rev 4711 =", greedy.stdout.strip()[len("rev 4711 =") :])


def test_a_sampling_flag_implies_sampling(cli):
    """--temperature 5 without --do-sample samples (flattened distribution: some answer changes)."""
    prompts = [f"rev {n} =" for n in (12345, 90817, 55501, 7310, 246802)]
    args = ["generate", "--max-new-tokens", "12", "--seed", "3"]
    for prompt in prompts:
        args += ["--prompt", prompt]
    greedy = cli(args)
    hot = cli(args + ["--temperature", "5"])
    explicit = cli(args + ["--temperature", "5", "--do-sample"])
    assert greedy.returncode == hot.returncode == explicit.returncode == 0, hot.stderr[-2000:]
    assert hot.stdout != greedy.stdout  # sampled, not silently greedy
    assert hot.stdout == explicit.stdout  # the same as asking for sampling explicitly


@pytest.mark.parametrize(
    "args, needles",
    [
        (["generate", "--prompt", ""], ["--prompt must not be empty"]),
        (["generate", "--prompt", "   "], ["--prompt must not be empty"]),
        (["generate", "--prompt", "x", "--tp", "0"], ["--tp must be >= 1, got 0"]),
        (["generate", "--prompt", "x", "--temperature", "-1"], ["--temperature must be >= 0"]),
        (["generate", "--prompt", "x", "--model", "Qwen/Qwen3.5-0.8B"], ["not a local folder", "download"]),
        (["generate", "--prompt", "x", "--model", "/nonexistent/dir"], ["'/nonexistent/dir' does not exist"]),
        (["bench", "models", "--batch", "0"], ["--batch: must be >= 1, got 0"]),
        (["bench", "models", "--backends", "hf,torch"], ["--backends", "torch, mindspore", "'hf,torch'"]),
        (["bench", "models", "--prompt-len", "10", "--min-prompt-len", "50"], ["--min-prompt-len (50)"]),
        (["bench", "models", "--repeats", "x"], ["--repeats: must be an integer, got 'x'"]),
        (["bench", "models", "--threads", "-1"], ["--threads: must be >= 0, got -1"]),
        (["bench", "serve", "--concurrency", "1,0"], ["--concurrency", "'1,0'"]),
        (["serve", "--block-size", "0"], ["--block-size must be >= 1, got 0"]),
        (["serve", "--max-num-batched-tokens", "-4"], ["--max-num-batched-tokens must be >= 1, got -4"]),
        (["serve", "--cache-memory-bytes", "100"], ["cache_memory_bytes=100 cannot hold one KV cache block"]),
        (["bench", "engine", "--scenarios", "prefix,nope"], ["--scenarios: 'nope' is not one of prefix"]),
        # a multi-rank bench without its launcher: fixable, so exit 2 and one line, not exit 1
        (["bench", "tp"], ["hyper-gen bench: error: tp runs on 2 ranks", "torchrun --nproc_per_node 2", "msrun"]),
        (["bench", "cp"], ["hyper-gen bench: error: cp runs on 2 ranks"]),
        (["bench", "rollout"], ["hyper-gen bench: error: rollout runs on 2 ranks"]),
        (["bench", "text", "--tokenizer", "/nonexistent/dir"], ["hyper-gen bench: error: ", "/nonexistent/dir"]),
    ],
)
def test_bad_flags_are_one_line_errors(args, needles, cli):
    _one_line_error(cli(args), *needles)


def test_missing_tokenizer_config_is_named(tmp_path, cli):
    model = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, model)
    os.remove(model / "tokenizer_config.json")
    _one_line_error(cli(["generate", "--prompt", "x", "--model", str(model)]), "tokenizer_config.json")


def test_load_model_error_is_shown_not_a_tokenizer_traceback(tmp_path, cli):
    """The model loads before the tokenizer: a checkpoint problem is the one line the user sees."""
    model = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, model)
    config = json.loads((model / "config.json").read_text())
    del config["vocab_size"]
    (model / "config.json").write_text(json.dumps(config))
    _one_line_error(cli(["generate", "--prompt", "x", "--model", str(model)]), "vocab_size")


def test_mindspore_is_quiet_by_default_and_verbose_on_request():
    quiet_env = {k: v for k, v in _env().items() if k != "GLOG_v"}
    quiet = run_cli(["generate", "--backend", "mindspore", "--prompt", "rev 12 ="], env=quiet_env)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stdout.strip() == "rev 12 = 21"
    assert "WARNING" not in quiet.stderr and "libge_runner" not in quiet.stderr, quiet.stderr
    loud = run_cli(["generate", "--backend", "mindspore", "--prompt", "rev 12 =", "-v"], env=quiet_env)
    assert loud.returncode == 0 and loud.stdout.strip() == "rev 12 = 21"


def test_chat_ignores_blank_lines_and_survives_an_overlong_one(cli):
    long_line = "1" * 700  # the demo model's context is 512 tokens
    result = cli(["chat", "--max-new-tokens", "12"], stdin=f"rev 12 =\n\n   \n{long_line}\nrev 34 =\nexit\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "message too long" in result.stdout
    replies = [part.split("User:")[0].strip() for part in result.stdout.split("Assistant:")[1:]]
    assert replies == ["21", "43"], result.stdout


def test_chat_history_is_trimmed_to_the_context():
    from transformers import AutoTokenizer

    from hyper_gen.cli.chat import fit_context

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    messages = []
    for _ in range(40):
        messages += [{"role": "user", "content": "rev 12345678 ="}, {"role": "assistant", "content": "87654321"}]
    messages.append({"role": "user", "content": "rev 1 ="})
    kept, ids = fit_context(tokenizer, messages, 512, 128)
    assert ids.shape[1] + 128 <= 512 and kept[-1] == messages[-1] and kept == messages[-len(kept) :]
    assert fit_context(tokenizer, messages, None, 128)[0] == messages
    assert fit_context(tokenizer, [{"role": "user", "content": "x" * 600}], 512, 128)[1] is None


def test_ctrl_c_in_chat_is_one_line():
    proc = subprocess.Popen(
        CLI + ["chat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=REPO,
    )
    deadline = time.time() + 120
    line = ""
    while time.time() < deadline and "Entering chat" not in line:
        line = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "hyper-gen: interrupted", err
