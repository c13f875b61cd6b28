"""``hyper_gen.chat`` / ``hyper_gen.ChatSession`` on a model the caller holds, in one process and on
every rank of a torchrun job (tests/dist_scripts/chat_job.py): the demo checkpoint under FSDP2, and
examples/chat_fsdp2_ep.py's Qwen3.5 MoE with its experts split over 2 ranks by its own all_to_all
(FSDP2 over the rest, or bare with ``collective_forward = True``), float64.

Each job's transcripts (greedy with a blank line, an overlong message and an exit word, and a pause
past the group's collective timeout; seeded sampling with a system message ending at EOF) and its
ChatSession turns (send, asend, reset, a refused message) equal the single unsharded process's; the
other rank wrote nothing and returned the same history; every rank exited 0.
"""

import json
import os
import subprocess
import sys

import pytest
from demo_task import is_correct
from launch import REPO, _env, msrun, script, torchrun

TIMEOUT_S, PAUSE_S = 5, 12  # the torchrun jobs' group timeout, and rank 0's pause between two lines


def _single(kind, tmp_path):
    out = tmp_path / f"one-{kind}"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, script("chat_job.py"), kind, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "rank0.json").read_text())


def _job(kind, tmp_path, *flags):
    out = tmp_path / f"two-{kind}"
    out.mkdir()
    result = torchrun([script("chat_job.py"), kind, str(out), *flags], timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _check_session(session):
    turns = session["turns"]
    for turn in turns[:4]:  # every streamed turn: the pieces joined are the reply the history keeps
        assert turn["pieces"] and "".join(turn["pieces"]) == turn["reply"], turn
    assert turns[3] == turns[0]  # after reset() the first turn again, seed and all
    assert len(session["before_reset"]) == 6 and session["history"] == session["before_reset"][:2]
    assert "message too long" in turns[4]["refused"]


def _check_same(single, ranks):
    zero, one = ranks
    for chat in ("greedy", "sampled"):
        assert zero[chat]["transcript"] == single[chat]["transcript"], chat
        assert zero[chat]["history"] == one[chat]["history"] == single[chat]["history"], chat
        assert one[chat]["transcript"] == ""
    assert zero["session"] == single["session"]
    assert one["session"]["history"] == single["session"]["history"]
    assert zero["stdout"] == one["stdout"] == ""  # the transcript went to rank 0's output= only


def _check_transcripts(single, context):
    greedy = single["greedy"]
    assert greedy["transcript"].count("Assistant: ") == 3
    assert f"(message too long: the model's context is {context} tokens" in greedy["transcript"]
    assert greedy["transcript"].endswith("User:  Exit \n\n")  # the exit word ended it; "never read" was not
    assert [m["content"] for m in greedy["history"] if m["role"] == "user"] == ["rev 12 =", "rev 345 =", "rev 6 ="]
    sampled = single["sampled"]
    assert sampled["history"][0] == {"role": "system", "content": "Reverse."}
    assert sampled["transcript"].endswith("User: \n")  # EOF
    _check_session(single["session"])


@pytest.mark.distributed
@pytest.mark.slow
def test_demo_model_under_fsdp2_chats_as_one_process_through_a_pause(tmp_path):
    single = _single("demo", tmp_path)
    _check_transcripts(single, 512)
    replies = [m["content"] for m in single["greedy"]["history"] if m["role"] == "assistant"]
    assert all(is_correct(p, " " + r) for p, r in zip(["rev 12 =", "rev 345 =", "rev 6 ="], replies)), replies
    _check_same(single, _job("demo", tmp_path, "--timeout", str(TIMEOUT_S), "--pause", str(PAUSE_S)))


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_moe_chats_as_the_unsharded_model(tmp_path):
    single = _single("ep", tmp_path)  # in one process: HF's own experts, nothing split
    _check_transcripts(single, 128)
    _check_same(single, _job("ep", tmp_path, "--timeout", str(TIMEOUT_S), "--pause", str(PAUSE_S)))
    _check_same(single, _job("ep_bare", tmp_path))  # no FSDP: collective_forward = True


def _mindspore_run(tmp_path, tp):
    out = tmp_path / f"ms-tp{tp}"
    out.mkdir()
    if tp == 1:
        result = subprocess.run(
            [sys.executable, script("chat_mindspore.py"), str(out)],
            capture_output=True,
            text=True,
            timeout=300,
            env=_env(),
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return [json.loads((out / "rank0.json").read_text())]
    result = msrun([script("chat_mindspore.py"), str(out)], log_dir=str(tmp_path / "logs"), timeout=400)
    assert result.returncode == 0, result.worker_logs[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)]


@pytest.mark.distributed
@pytest.mark.slow
def test_mindspore_session_streams_its_replies_alone_and_under_msrun_tp2(tmp_path):
    (single,) = _mindspore_run(tmp_path, 1)
    for turn in single["turns"]:
        assert turn["pieces"] and "".join(turn["pieces"]) == turn["reply"], turn
    assert [t["reply"] for t in single["turns"]] == [m["content"] for m in single["session"][1::2]]
    assert [m["content"] for m in single["history"][1::2]] == ["21", "809"]
    assert single["transcript"] == "User: rev 12 =\nAssistant: 21\nUser: rev 908 =\nAssistant: 809\nUser: exit\n\n"
    zero, one = _mindspore_run(tmp_path, 2)
    assert zero["turns"] == single["turns"] and zero["transcript"] == single["transcript"]
    assert zero["session"] == one["session"] == single["session"]
    assert zero["history"] == one["history"] == single["history"] and one["transcript"] == ""


@pytest.fixture(scope="module")
def demo():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hyper_gen.demo import demo_model_path

    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(demo_model_path())


def test_session_in_one_process_streams_and_refuses_what_it_cannot_take(demo):
    import hyper_gen

    model, tokenizer = demo
    with hyper_gen.ChatSession(model, tokenizer, max_new_tokens=8) as session:
        reply = session.send("rev 4711 =")
        assert "".join(reply) == reply.text == session.history[-1]["content"] == "1174"
        with pytest.raises(TypeError, match="text must be a string"):
            session.send(b"rev 1 =")
        with pytest.raises(hyper_gen.chat_session.MessageTooLong, match="context is 512 tokens"):
            session.send("1" * 700)
        assert len(session.history) == 2  # the refused message left the conversation as it was
        with pytest.raises(RuntimeError, match="follow\\(\\) runs on the ranks other than 0"):
            session.follow()
    with pytest.raises(RuntimeError, match="closed chat session"):
        session.send("rev 1 =")
    with pytest.raises(TypeError, match="system must be a string"):
        hyper_gen.ChatSession(model, tokenizer, system=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        hyper_gen.ChatSession(model, tokenizer, max_new_tokens=0)
    with pytest.raises(TypeError, match="input must be a callable"):
        hyper_gen.chat(model, tokenizer, input="rev 1 =")


def test_chat_reads_stdin_by_default_and_an_input_error_ends_it(demo, monkeypatch, capsys):
    import io

    import hyper_gen

    model, tokenizer = demo
    monkeypatch.setattr("sys.stdin", io.StringIO("rev 12 =\nquit\n"))
    history = hyper_gen.chat(model, tokenizer, max_new_tokens=8)
    assert capsys.readouterr().out == "User: Assistant: 21\nUser: \n"  # stdin's lines are not echoed
    assert history == [{"role": "user", "content": "rev 12 ="}, {"role": "assistant", "content": "21"}]

    def broken():
        raise OSError("the terminal went away")

    with pytest.raises(OSError, match="terminal went away"):
        hyper_gen.chat(model, tokenizer, input=broken, output=io.StringIO())


@pytest.mark.distributed
@pytest.mark.slow
def test_the_fsdp2_ep_example_trains_rolls_out_and_chats(tmp_path):
    result = torchrun([os.path.join(REPO, "examples", "chat_fsdp2_ep.py"), "--steps", "2"], timeout=400)
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-3000:]
    losses = [float(line.split("loss ")[1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and losses[1] < losses[0], out[-3000:]  # the experts' gradients came back too
    assert sum(" rollout: " in line and "logprob=" in line for line in out.splitlines()) == 3, out[-3000:]
    assert out.count("Assistant: ") == 2 and "User: rev 123 =" in out and "User: rev 45 =" in out, out[-3000:]
