"""Hardening of the CLI, the benchmarks' command line and JSONL jobs: bad input is one line and exit 2,
every bench flag is explained with its default, JSONL rows say "stop" as the engine and server do,
and the benchmarks are as quiet as the rest of the CLI.

In this process (tests/cli_runner.py), except where MindSpore's import-time log level is the point."""

import json
import os
import re
import subprocess
import sys

import pytest
from demo_task import make_prompts
from launch import REPO, _env

from hyper_gen.bench import build_parser
from hyper_gen.config import MAX_NEW_TOKENS, MAX_ROWS

CLI = [sys.executable, "-m", "hyper_gen"]
COMMANDS = (
    "loop",
    "hf",
    "models",
    "tp",
    "cp",
    "rollout",
    "serve",
    "router",
    "offline",
    "update",
    "logprobs",
    "invariance",
    "engine",
    "rl",
    "text",
)


def one_line_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("hyper-gen: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---- row 1: a prompt the model cannot take -------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_one_line_exit_2(backend, stream, cli):
    args = ["generate", "--backend", backend, "--prompt", "1" * 600] + (["--stream"] if stream else [])
    one_line_error(cli(args), "--prompt is 600 tokens", "context of 512")


def test_the_prompt_at_fault_is_named_and_a_prompt_that_fits_still_runs(cli):
    one_line_error(
        cli(["generate", "--prompt", "rev 12 =", "--prompt", "1" * 512]), "--prompt 2 is 512 tokens", "as many as"
    )
    fits = cli(["generate", "--prompt", "1" * 511, "--max-new-tokens", "4"])  # stops at the context, as generate()
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert fits.stdout.startswith("1" * 511)


def test_a_prompt_that_is_not_utf8_is_one_line_before_the_model_loads(cli):
    # what the shell passes for bytes that are not UTF-8 (os.fsdecode's surrogateescape)
    one_line_error(cli(["generate", "--prompt", "rev \udcff =", "--backend", "no-such"]), "not UTF-8", "character 4")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--max-new-tokens", str(10**12)], ["max_new_tokens must be <=", str(MAX_NEW_TOKENS), "MAX_NEW_TOKENS"]),
        (["--batch-size", str(10**12)], ["--batch-size must be in [1,", str(MAX_ROWS)]),
        (["--batch-size", "0"], ["--batch-size must be in [1,"]),
    ],
)
def test_sizes_the_cli_takes_are_bounded(args, needles, cli):
    one_line_error(cli(["generate", "--prompt", "rev 12 ="] + args), *needles)


def test_more_prompts_than_a_call_takes_is_one_line(cli, monkeypatch):
    """What generate() rejects in a --prompt batch is the one line it names, not its traceback."""
    import hyper_gen.config as config_module

    monkeypatch.setattr(config_module, "MAX_ROWS", 2)
    args = ["generate", "--prompt", "rev 1 =", "--prompt", "rev 2 =", "--prompt", "rev 3 ="]
    one_line_error(cli(args), "3 rows x num_return_sequences=1 = 3 rows", "MAX_ROWS = 2")


def test_a_hub_id_gets_the_download_hint_from_the_shared_wording(cli):
    from hyper_gen.models.checkpoint import folder_problem

    result = cli(["generate", "--prompt", "x", "--model", "Qwen/Qwen3.5-0.8B"])
    line = one_line_error(result, "hf download")
    assert line == "hyper-gen: error: " + folder_problem("Qwen/Qwen3.5-0.8B", "pass --model DIR")


# ---- row 2: bench --help -------------------------------------------------------------------------
def _normalized(text):
    return " ".join(text.split())


def test_bench_help_lists_every_command_with_its_line(cli):
    result = cli(["bench", "--help"])
    assert result.returncode == 0, result.stderr
    subcommands = next(a for a in build_parser()._actions if a.dest == "which")
    assert tuple(subcommands.choices) == COMMANDS
    summaries = {action.dest: action.help for action in subcommands._choices_actions}
    for name in COMMANDS:
        assert summaries[name], name
        assert re.search(rf"^\s+{name}\s+{re.escape(summaries[name])}$", result.stdout, re.M), (name, result.stdout)
    run_line = re.search(r"Run: hyper-gen bench \[([a-z|]+)\]", result.stdout)
    assert run_line and run_line.group(1).split("|") == list(COMMANDS), result.stdout
    assert "``" not in result.stdout  # the docstring's reST literals are shown plain


def test_offline_bench_help_shows_no_rest_markup():
    result = subprocess.run(
        [sys.executable, "-m", "hyper_gen.bench.offline", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=REPO,
    )
    assert result.returncode == 0 and "JSONL" in result.stdout and "``" not in result.stdout, result


@pytest.mark.parametrize("name", COMMANDS)
def test_every_bench_flag_is_explained_with_its_default(name, cli):
    result = cli(["bench", name, "--help"])
    assert result.returncode == 0, result.stderr
    assert "``" not in result.stdout
    text = _normalized(result.stdout)
    parser = next(a for a in build_parser()._actions if a.dest == "which").choices[name]
    flags = [a for a in parser._actions if a.dest != "help"]
    assert flags
    for action in flags:
        assert action.help, f"bench {name} {action.option_strings} has no help"
        assert _normalized(action.help) in text, (action.option_strings, text)
    # each flag's help is followed by its default, or says what it is itself
    assert text.count("(default") == len(flags), text
    for action in flags:
        if "(default" not in action.help and action.default is not None:
            assert f"{_normalized(action.help)} (default: {action.default})" in text, (action.option_strings, text)


def test_python_m_hyper_gen_bench_runs_the_same_parser():
    result = subprocess.run(
        [sys.executable, "-m", "hyper_gen.bench", "models", "--batch", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=REPO,
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "hyper-gen bench models: error: argument --batch: must be >= 1, got 0"
    ], result.stderr


# ---- row 3: finish_reason ------------------------------------------------------------------------
def _rows(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for key, prompt in rows.items():
            f.write(json.dumps({"id": key, "prompt": prompt}) + "\n")


def _read(path):
    return {r["id"]: r for r in map(json.loads, open(path, encoding="utf-8").read().splitlines())}


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
@pytest.mark.parametrize("batching", ["inflight", "fixed"])
def test_jsonl_rows_finish_with_stop_and_a_job_with_old_eos_rows_resumes(tmp_path, backend, batching, cli):
    prompts = {f"row-{i}": prompt for i, (prompt, _) in enumerate(make_prompts(3, seed=5))}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _rows(inp, prompts)
    old = dict(id="row-0", prompt=prompts["row-0"], completion=" x", completion_tokens=2, finish_reason="eos")
    out.write_text(json.dumps(old) + "\n")  # written by an earlier version
    args = ["generate", "--input", inp, "--output", out, "--backend", backend, "--batching", batching]
    result = cli(args + ["--max-new-tokens", "12"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _read(out)
    assert rows["row-0"] == old  # done before: skipped, kept as it was
    assert {rows[k]["finish_reason"] for k in ("row-1", "row-2")} == {"stop"}, rows
    cut = tmp_path / "cut.jsonl"
    result = cli(args[:4] + [cut] + args[5:] + ["--max-new-tokens", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert {r["finish_reason"] for r in _read(cut).values()} == {"length"}


def test_a_rows_max_tokens_past_the_bound_is_a_skipped_line(tmp_path, cli):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        json.dumps({"id": 1, "prompt": "rev 12 =", "max_tokens": 10**30})
        + "\n"
        + json.dumps({"id": 2, "prompt": "rev 34 ="})
        + "\n"
    )
    result = cli(["generate", "--input", inp, "--output", out, "--max-new-tokens", "12"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'"max_tokens" must be <= {MAX_NEW_TOKENS}' in result.stderr and "in.jsonl:1" in result.stderr
    assert list(_read(out)) == [2]


# ---- row 4: bench loop is quiet ------------------------------------------------------------------
@pytest.mark.parametrize("verbose", [False, True])
def test_bench_silences_framework_logs_before_the_command_imports_one(verbose, cli, monkeypatch):
    import hyper_gen.bench.loop as loop

    seen = {}
    monkeypatch.setattr(loop, "run_loop", lambda args: seen.update(GLOG_v=os.environ.get("GLOG_v")))
    env = {k: v for k, v in os.environ.items() if k not in ("GLOG_v", "TRANSFORMERS_VERBOSITY")}
    result = cli(["bench", "loop"] + (["-v"] if verbose else []), env=env)
    assert result.returncode == 0, result.stderr
    assert seen == {"GLOG_v": None if verbose else "3"}


@pytest.mark.slow  # a MindSpore import in a fresh process: its log level is read then
def test_bench_loop_prints_no_mindspore_warnings():
    env = {k: v for k, v in _env().items() if k != "GLOG_v"}
    result = subprocess.run(
        CLI + ["bench", "loop", "--backends", "mindspore", "--batch", "1", "--vocab", "64", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr and "Ascend" not in result.stderr, result.stderr
    assert "backend ops per decode step" in result.stdout


# ---- the same class of defect around them --------------------------------------------------------
@pytest.mark.parametrize(
    "args, needles",
    [
        (["generate", "--prompt", "x", "--max-new-tokens", "1e3"], ["hyper-gen generate: error:", "'1e3'"]),
        (["chat", "--top-p", "x"], ["hyper-gen chat: error:", "--top-p"]),
        (["serve", "--port", "x"], ["hyper-gen serve: error:", "--port"]),
        (["generat"], ["hyper-gen: error:", "invalid choice: 'generat'"]),
    ],
)
def test_flags_argparse_rejects_are_one_line_too(args, needles, cli):
    result = cli(args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(needle in lines[0] for needle in needles), result.stderr


def test_an_empty_model_path_is_not_the_demo_model(cli):
    one_line_error(cli(["generate", "--prompt", "rev 12 =", "--model", ""]), "model path '' does not exist")


def test_chat_refuses_a_line_that_is_not_utf8_and_goes_on(cli):
    result = cli(["chat", "--max-new-tokens", "12"], stdin="rev 12 =\n\udcff\udcfe\nrev 34 =\nexit\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "message is not UTF-8 text" in result.stdout
    replies = [part.split("User:")[0].strip() for part in result.stdout.split("Assistant:")[1:]]
    assert replies == ["21", "43"], result.stdout
