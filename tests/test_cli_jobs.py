"""Resumable JSONL jobs that no input breaks: the CLI on the bundled demo model, in this process
(tests/cli_runner.py), and as a real process where Ctrl-C (a signal) is the point.

Bad rows become error records, undecodable lines are skipped, paths that cannot work are refused
before the model loads, a corrupt output file is named with its line, and the job ends with one
summary line (or, on Ctrl-C, one line saying how to resume).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from demo_task import DEMO_MODEL_DIR, is_correct, make_prompts
from launch import REPO, _env, torchrun

from hyper_gen.config import GenerationConfig
from hyper_gen.jobs import jsonl as batch_jobs
from hyper_gen.jobs.tokenizer import load_tokenizer

CLI = [sys.executable, "-m", "hyper_gen"]
SUMMARY = re.compile(
    r"hyper-gen: (\d+) rows?: (\d+) generated, (\d+) errors?(?: \([^)]*\))?, (\d+) already done; "
    r"(\d+) tokens in [\d.]+ s \((?:\d+|-) tok/s\) -> (.+)"
)


def run_cli(args, timeout=300):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)


def job_args(inp, out, *extra):
    return ["generate", "--input", str(inp), "--output", str(out), "--max-new-tokens", "12", *extra]


def messages(stderr):
    """stderr's lines other than tqdm's progress bar (which redraws itself with carriage returns)."""
    lines = re.split(r"[\r\n]+", stderr)
    return [line for line in lines if line.strip() and not line.startswith("generate:")]


def summary(stderr):
    """(rows, generated, errors, already done, tokens, output path) of the job's last line."""
    match = SUMMARY.fullmatch(messages(stderr)[-1])
    assert match, stderr[-2000:]
    return tuple(int(g) for g in match.groups()[:5]) + (match.group(6),)


def read_jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8").read().splitlines()]


def write_lines(path, lines):
    """Raw lines: str lines are JSON text (escapes such as \\ud800 stay escapes), bytes go as they are."""
    with open(path, "wb") as f:
        for line in lines:
            f.write((line.encode("utf-8") if isinstance(line, str) else line) + b"\n")


def good_rows(n, seed):
    return {f"good-{i}": prompt for i, (prompt, _) in enumerate(make_prompts(n, seed=seed))}


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_bad_rows_become_error_records_and_the_job_goes_on(tmp_path, backend, cli):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = good_rows(4, seed=21)
    rows = [json.dumps({"id": key, "prompt": prompt}) for key, prompt in good.items()]
    bad = {  # input line -> (id, what the error says)
        2: (1, "empty prompt"),
        3: ("blank", "only whitespace"),
        4: ("surrogate", "lone surrogate"),
        5: ("huge", "more than the model's context of 512"),  # 1 MB, far past max_position_embeddings
        6: ("tight", "503 tokens: with max_new_tokens=12 that is 515 positions"),  # fits alone, not with 12 more
    }
    lines = [
        rows[0],
        json.dumps({"id": 1, "prompt": ""}),
        json.dumps({"id": "blank", "prompt": " \t "}),
        '{"id": "surrogate", "prompt": "rev \\ud800 ="}',
        json.dumps({"id": "huge", "prompt": "rev 1 " * 175_000}),
        json.dumps({"id": "tight", "prompt": "rev " + "1" * 497 + " ="}),
        *rows[1:],
    ]
    write_lines(inp, lines)
    result = cli(job_args(inp, out, "--backend", backend, "--batch-size", "3"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr
    records = {json.dumps(r["id"]): r for r in read_jsonl(out)}  # completion order: matched by id
    assert len(records) == len(good) + len(bad)
    for number, (row_id, says) in bad.items():
        record = records[json.dumps(row_id)]
        assert set(record) == {"id", "error"} and says in record["error"] and "\n" not in record["error"], record
        assert f"{inp}:{number}: id {row_id!r}: " in result.stderr, result.stderr[-3000:]
    for key, prompt in good.items():
        record = records[json.dumps(key)]
        assert record["prompt"] == prompt and is_correct(prompt, record["completion"]), record
        assert record["finish_reason"] == "stop"
    rows_, generated, errors, done, tokens, path = summary(result.stderr)
    assert (rows_, generated, errors, done, path) == (9, 4, 5, 0, str(out)) and tokens > 0

    before = out.read_bytes()
    again = cli(job_args(inp, out, "--backend", backend))  # error records count as done: no retry loop
    assert again.returncode == 0, again.stderr[-3000:]
    assert out.read_bytes() == before
    assert summary(again.stderr)[:5] == (9, 0, 0, 9, 0)


def test_a_batch_generate_rejects_is_retried_row_by_row(tmp_path, monkeypatch):
    """A ValueError from generate costs only the row that caused it, not its micro-batch."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = {"a": "rev 12 =", "poison": "rev 34 =", "c": "rev 56 =", "d": "rev 78 ="}
    write_lines(inp, [json.dumps({"id": key, "prompt": p}) for key, p in prompts.items()])
    calls = []

    def fake_completions(model, tokenizer, batch, config):
        calls.append(list(batch))
        if prompts["poison"] in batch:
            raise ValueError("generate says no\nsecond line")
        return [" ok"] * len(batch), [2] * len(batch), ["stop"] * len(batch)

    monkeypatch.setattr(batch_jobs, "completions", fake_completions)
    job = batch_jobs.open_job(str(inp), str(out))
    config = GenerationConfig(max_new_tokens=4, eos_token_id=1, pad_token_id=0)
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    assert batch_jobs.run_jsonl(None, tokenizer, config, job, batch_size=4, context=512, batching="fixed") == 0
    records = {r["id"]: r for r in read_jsonl(out)}
    assert records["poison"] == {"id": "poison", "error": "generate says no"}
    assert all(records[key]["completion"] == " ok" for key in ("a", "c", "d"))
    assert len(calls) == 1 + len(prompts)  # the batch, then each of its rows alone


def test_invalid_utf8_line_is_skipped_with_its_line_number(tmp_path, cli):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = good_rows(3, seed=22)
    rows = [json.dumps({"id": key, "prompt": prompt}) for key, prompt in good.items()]
    write_lines(inp, [rows[0], b'{"id": "latin1", "prompt": "rev 1\xe92 ="}', rows[1], b"\xff\xfe\x00", *rows[2:]])
    result = cli(job_args(inp, out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"{inp}:2: skipped malformed line (not UTF-8: byte 0xe9" in result.stderr
    assert f"{inp}:4: skipped malformed line (not UTF-8: byte 0xff" in result.stderr
    assert {r["id"] for r in read_jsonl(out)} == set(good)
    assert summary(result.stderr)[:4] == (3, 3, 0, 0)


def _refused(result, *names):
    """Exit 2 with one line naming each of ``names``, before anything loaded."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyper-gen: error: "), result.stderr
    for name in names:
        assert str(name) in lines[0], lines[0]
    return lines[0]


# a --model that is not a checkpoint: were it looked at first, its error would come instead
def _no_model(tmp_path):
    return ["--model", str(tmp_path / "not-a-checkpoint")]


@pytest.mark.parametrize("spelling", ["same", "dotted", "symlink", "hardlink"])
def test_same_input_and_output_is_refused(tmp_path, spelling, cli):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [json.dumps({"id": key, "prompt": p}) for key, p in good_rows(2, seed=23).items()])
    (tmp_path / "sub").mkdir()
    out = {"same": inp, "dotted": tmp_path / "sub" / ".." / "in.jsonl", "symlink": tmp_path / "link.jsonl"}.get(
        spelling, tmp_path / "hard.jsonl"
    )
    if spelling == "symlink":
        os.symlink(inp, out)
    elif spelling == "hardlink":
        os.link(inp, out)
    before = inp.read_bytes()
    message = _refused(cli(job_args(inp, out, *_no_model(tmp_path))), out)
    assert "same file" in message
    assert inp.read_bytes() == before


@pytest.mark.parametrize("case", ["missing dir", "under a file", "a directory", "read-only dir"])
def test_unwritable_output_is_refused_before_the_model_loads(tmp_path, case, cli):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [json.dumps({"id": 0, "prompt": "rev 12 ="})])
    if case == "missing dir":
        out, says = tmp_path / "nowhere" / "out.jsonl", "does not exist"
    elif case == "under a file":
        (tmp_path / "somefile").write_text("")
        out, says = tmp_path / "somefile" / "out.jsonl", "is not a directory"
    elif case == "a directory":
        (tmp_path / "outdir").mkdir()
        out, says = tmp_path / "outdir", "is a directory"
    elif os.geteuid() == 0:  # root writes to any directory whatever its mode; sysfs refuses even root
        out, says = "/sys/out.jsonl", "cannot be written"
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        out, says = tmp_path / "ro" / "out.jsonl", "cannot be written"
    message = _refused(cli(job_args(inp, out, *_no_model(tmp_path))), out)
    assert says in message


@pytest.mark.parametrize(
    "corrupt",
    [b'{"id": "a", "compl', b"\xff\xfe not utf-8", b"[1, 2]"],
    ids=["cut-json", "not-utf8", "not-an-object"],
)
def test_corrupt_line_inside_the_output_is_named(tmp_path, corrupt, cli):
    """Only a partial LAST line (a kill mid-write) is cut off by itself (tests/test_cli.py)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = good_rows(3, seed=24)
    write_lines(inp, [json.dumps({"id": key, "prompt": p}) for key, p in good.items()])
    done = [json.dumps({"id": key, "completion": " x"}) for key in list(good)[:2]]
    write_lines(out, [done[0], corrupt, done[1]])
    before = out.read_bytes()
    message = _refused(cli(job_args(inp, out, *_no_model(tmp_path))), f"{out}:2:")
    assert "corrupt line" in message and "delete line 2" in message
    assert out.read_bytes() == before


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_ctrl_c_exits_130_with_one_line_and_the_rerun_resumes(tmp_path, backend, cli):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = good_rows(60, seed=25)
    write_lines(inp, [json.dumps({"id": key, "prompt": p}) for key, p in good.items()])
    args = job_args(inp, out, "--backend", backend, "--batch-size", "1")
    proc = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    deadline = time.time() + 180
    while time.time() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    stderr = err.decode("utf-8", "replace")
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = messages(stderr)
    assert len(lines) == 1, stderr[-3000:]
    match = re.fullmatch(
        r"hyper-gen: interrupted after (\d+) of 60 rows; '(.+)' keeps every finished row: "
        r"run the same command again to resume",
        lines[0],
    )
    assert match and match.group(2) == str(out), lines[0]
    written = len(out.read_bytes().splitlines())
    assert 3 <= int(match.group(1)) <= written <= int(match.group(1)) + 1 < 60, (lines[0], written)
    if backend == "torch":  # resuming after a kill is tests/test_cli.py's; here: after Ctrl-C
        result = cli(args)  # the Ctrl-C needed a process; the rerun does not
        assert result.returncode == 0, result.stderr[-3000:]
        rows = read_jsonl(out)
        assert sorted(r["id"] for r in rows) == sorted(good)
        assert summary(result.stderr)[:4] == (60, 60 - written, 0, written)


@pytest.mark.distributed
def test_resume_under_torchrun_tp2_rank0_writes(tmp_path):
    """Every rank skips the rows already done (else their batches differ and generate refuses);
    only rank 0 writes, each row once."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = good_rows(6, seed=26)
    write_lines(inp, [json.dumps({"id": key, "prompt": p}) for key, p in good.items()] + ['{"id": "e", "prompt": ""}'])
    first = list(good)[:2]
    write_lines(out, [json.dumps({"id": key, "completion": "earlier run"}) for key in first])
    with open(out, "ab") as f:
        f.write(b'{"id": "half", "compl')  # killed mid-write
    result = torchrun(["-m", "hyper_gen", *job_args(inp, out, "--tp", "2", "--batch-size", "2")], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_jsonl(out)
    assert sorted(json.dumps(r["id"]) for r in rows) == sorted(json.dumps(key) for key in [*good, "e"])
    for row in rows:
        if row["id"] in first:
            assert row["completion"] == "earlier run"
        elif row["id"] == "e":
            assert row == {"id": "e", "error": "empty prompt"}
        else:
            assert is_correct(good[row["id"]], row["completion"]), row
    assert summary(result.stdout + result.stderr)[:4] == (7, 4, 1, 2)


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_inflight_rows_equal_fixed_micro_batches_and_seeds_follow_the_row(tmp_path, backend):
    """Refilling finished rows changes no greedy completion; under --seed a row's sample depends on its
    id only (not on its batch or on which rows a resumed run skips), and equal prompts differ."""
    from hyper_gen import load_model

    model = load_model(DEMO_MODEL_DIR, backend=backend)
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    inp = tmp_path / "in.jsonl"
    good = good_rows(10, seed=27)
    good["twin"] = good["good-0"]
    write_lines(inp, [json.dumps({"id": key, "prompt": p}) for key, p in good.items()])

    def run(name, config, batch_size, batching, done=()):
        out = tmp_path / f"{name}.jsonl"
        write_lines(out, [json.dumps({"id": key, "completion": "earlier"}) for key in done])
        job = batch_jobs.open_job(str(inp), str(out))
        assert batch_jobs.run_jsonl(model, tokenizer, config, job, batch_size, context=512, batching=batching) == 0
        return {r["id"]: r for r in read_jsonl(out) if r["id"] not in done}

    greedy = GenerationConfig(max_new_tokens=12, eos_token_id=1, pad_token_id=0)
    inflight, fixed = run("inflight", greedy, 3, "inflight"), run("fixed", greedy, 3, "fixed")
    assert inflight == fixed and all(is_correct(good[k], r["completion"]) for k, r in inflight.items())
    assert {r["finish_reason"] for r in inflight.values()} == {"stop"}
    if backend == "mindspore":  # the seeded draw is host numpy, the same on every backend (tests/test_engine.py)
        return
    sampled = greedy.replace(do_sample=True, temperature=2.5, top_k=0, seed=3)
    wide = run("wide", sampled, 4, "inflight")
    narrow = run("narrow", sampled, 1, "inflight", done=["good-1", "good-2"])
    assert all(narrow[key] == wide[key] for key in narrow) and len(narrow) == len(good) - 2
    assert wide["twin"]["completion"] != wide["good-0"]["completion"]


def test_rows_with_their_own_max_tokens(tmp_path, capsys):
    """A row's "max_tokens" replaces --max-new-tokens for it, in both batchings; a bad one is a skipped line."""
    from hyper_gen import load_model

    model = load_model(DEMO_MODEL_DIR, backend="torch")
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    inp = tmp_path / "in.jsonl"
    limits = {f"r{i}": limit for i, limit in enumerate([3, 17, 1, 9, 30])}
    prompts = [p for p, _ in make_prompts(len(limits), seed=28)]
    lines = [json.dumps({"id": k, "prompt": p, "max_tokens": n}) for (k, n), p in zip(limits.items(), prompts)]
    write_lines(inp, lines + [json.dumps({"id": "bad", "prompt": "rev 1 =", "max_tokens": 0})])
    config = GenerationConfig(max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    records = {}
    for batching in ("inflight", "fixed"):
        out = tmp_path / f"{batching}.jsonl"
        job = batch_jobs.open_job(str(inp), str(out))
        assert batch_jobs.run_jsonl(model, tokenizer, config, job, 2, context=512, batching=batching) == 0
        records[batching] = {r["id"]: r for r in read_jsonl(out)}
    assert records["inflight"] == records["fixed"]
    assert {k: r["completion_tokens"] for k, r in records["fixed"].items()} == limits
    assert all(r["finish_reason"] == "length" for r in records["fixed"].values())
    assert '"max_tokens" must be a positive integer, got 0' in capsys.readouterr().err
