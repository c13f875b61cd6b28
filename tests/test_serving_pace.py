"""What serving a token costs besides the step (the serving-pace issue), torch and MindSpore.

One event-loop wake-up per step serves every stream on that loop (not one per stream), each stream's
tokens still exactly generate()'s; a one-stream response reads its stream with no task or queue in
between and still ends at once when the server interrupts it; a streamed chunk's JSON is the fixed
fields encoded once plus its choice, byte for byte what the pydantic response model gives.
"""

import asyncio
import re

import numpy as np
import pytest
from demo_task import DEMO_MODEL_DIR
from transformers import AutoTokenizer

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.engine import Engine, SamplingParams
from hyper_gen.engine.stream import RequestStream
from hyper_gen.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from hyper_gen.server.streams import Frames, Requests, ServerClosing, sse

STREAMS, TOKENS = 6, 8


def _prompts(n):
    rng = np.random.default_rng(0)
    return [rng.integers(3, 90, int(rng.integers(5, 12))).tolist() for _ in range(n)]


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_one_loop_wake_per_step_serves_every_stream(backend, one_torch_thread):
    model = load_model(DEMO_MODEL_DIR, backend=backend)
    prompts = _prompts(STREAMS)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    loop = asyncio.new_event_loop()
    wakes = []
    plain = loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):
        wakes.append(callback)
        return plain(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted

    async def consume(engine):
        async def one(prompt):
            return [t for chunk in [c async for c in engine.generate(prompt, params)] for t in chunk.token_ids]

        return await asyncio.gather(*(one(p) for p in prompts))

    with Engine(model, AutoTokenizer.from_pretrained(DEMO_MODEL_DIR), max_num_seqs=STREAMS) as engine:
        try:
            got = loop.run_until_complete(consume(engine))
        finally:
            loop.close()
    config = GenerationConfig(max_new_tokens=TOKENS, min_new_tokens=TOKENS, eos_token_id=None, pad_token_id=0)
    for prompt, ids in zip(prompts, got):
        expected = generate(model, np.asarray([prompt]), config)
        assert ids == np.asarray(expected)[0, len(prompt) :].tolist()
    chunks = STREAMS * TOKENS
    # a wake-up per step (about TOKENS + a few admissions and the ends), not one per chunk
    assert len(wakes) <= TOKENS + STREAMS + 2 < chunks, (len(wakes), chunks)


@pytest.mark.parametrize("streams", [1, 2])
def test_an_interrupted_response_ends_at_once(streams):
    requests = Requests([RequestStream("r", lambda: None) for _ in range(streams)])  # a stuck engine's

    async def read():
        async def later():
            await asyncio.sleep(0.05)
            requests.interrupt()

        asyncio.get_running_loop().create_task(later())
        with pytest.raises(ServerClosing):
            async for _ in requests.chunks():
                pass

    asyncio.run(asyncio.wait_for(read(), 10))


def test_a_chunks_json_is_the_models():
    head = dict(id="cmpl-1", created=7, model='a "choices": [] model')
    frames = Frames(CompletionResponse, CompletionChoice, head)
    for values in (dict(index=0, text="é\n"), dict(index=3, text="", finish_reason="stop", token_ids=[1, 2])):
        expected = sse(CompletionResponse(**head, choices=[CompletionChoice(**values)]))
        assert frames.event(frames.choice(**values)) == expected
    frames = Frames(ChatCompletionChunk, ChatChunkChoice, head)
    for content, reasoning in (("hi", None), (None, "so"), (None, None)):
        delta = {k: v for k, v in (("content", content), ("reasoning_content", reasoning)) if v is not None}
        made = frames.event(frames.choice(index=1, delta=delta, finish_reason="length"))
        choice = ChatChunkChoice(
            index=1, delta=DeltaMessage(content=content, reasoning_content=reasoning), finish_reason="length"
        )
        assert made == sse(ChatCompletionChunk(**head, choices=[choice]))
    with pytest.raises(TypeError, match="not a choice field"):
        frames.choice(index=0, text="x")


@pytest.mark.slow
def test_bench_serve_prints_the_one_stream_ratio_beside_generate(cli):
    """``hyper-gen bench serve`` on the demo model: a row per level with the inter-token median, the
    interleaved ``generate()`` row, and the one-stream ratio line (a real server process)."""
    args = ["bench", "serve", "--requests", "2", "--max-tokens", "4", "--concurrency", "1,2", "--prompt-tokens", "8"]
    run = cli([*args, "--skip-offline", "--skip-static-batch"])
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "ITL p50 ms" in out and "server, 2 concurrent clients" in out
    assert "generate, the same requests between" in out
    assert re.search(r"one stream: the server's inter-token median [\d.]+ ms over generate\(\)'s decode step", out)
