"""``hyper-gen chat --shard fsdp2 | hyperparallel`` under torchrun: the demo checkpoint loaded with
transformers and sharded over both ranks (torch's FSDP2 / HyperParallel's ``fully_shard``); rank 0
reads stdin and prints the single-process chat's greedy replies, once. And the flag's usage errors."""

import pytest
from demo_task import is_correct
from hyperparallel_install import require_hyperparallel
from launch import torchrun

PROMPTS = ["rev 12345 =", "rev 908 ="]
STDIN = "\n".join(PROMPTS) + "\nexit\n"


def _replies(text):
    return [part.split("User:")[0].strip() for part in text.split("Assistant:")[1:]]


@pytest.mark.distributed
@pytest.mark.parametrize("sharder", ["fsdp2", "hyperparallel"])
def test_sharded_chat_under_torchrun_answers_as_one_process(sharder, cli):
    if sharder == "hyperparallel":
        require_hyperparallel()
    single = cli(["chat", "--max-new-tokens", "12"], stdin=STDIN)
    assert single.returncode == 0, single.stderr[-2000:]
    expected = _replies(single.stdout)
    assert len(expected) == len(PROMPTS) and all(is_correct(p, " " + r) for p, r in zip(PROMPTS, expected))

    args = ["-m", "hyper_gen", "chat", "--shard", sharder, "--max-new-tokens", "12"]
    result = torchrun(args, stdin=STDIN, timeout=240)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert out.count("Entering chat (torch, 2 ranks)") == 1, out[-3000:]  # rank 1 prints nothing
    # nothing of the libraries' lands between the prompt and the answer on a terminal: no per-rank
    # "Loading weights" bars, no FutureWarning from HyperParallel's collectives (-v shows them)
    assert "Loading weights" not in result.stderr and "Warning" not in result.stderr, result.stderr[-3000:]
    assert _replies(out) == expected, out[-3000:]


@pytest.mark.parametrize(
    "flags",
    [
        ["--shard", "hyperparallel", "--backend", "mindspore"],
        ["--shard", "fsdp2", "--tp", "2"],
        ["--shard", "bogus"],
        ["--shard", "fsdp2"],  # one process: nothing to shard over
    ],
    ids=["mindspore", "tp", "bogus", "one-process"],
)
def test_shard_usage_errors_are_one_line(flags, cli):
    result = cli(["chat", *flags], stdin="rev 12 =\nexit\n")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--shard" in lines[0], result.stderr
    assert "Assistant:" not in result.stdout
