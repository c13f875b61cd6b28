"""Streamers: the concatenated stream equals the decoded final output, on both backends."""

import io

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from hyper_gen import GenerationConfig, generate
from hyper_gen.streaming import TextIteratorStreamer, TextStreamer, generate_in_thread


def byte_tokenizer():
    """One token per byte, so multi-byte characters span several tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_multibyte_character_is_held_back_until_complete():
    tok = byte_tokenizer()
    ids = tok.encode("aé中").ids
    assert len(ids) == 1 + 2 + 3
    out = io.StringIO()
    streamer = TextStreamer(tok, skip_prompt=True, file=out)
    streamer.put(np.array([[1, 2]]))  # the prompt, skipped
    pieces = []
    for token in ids:
        before = out.getvalue()
        streamer.put(np.array([token]))
        pieces.append(out.getvalue()[len(before) :])
    streamer.end()
    assert pieces == ["a", "", "é", "", "", "中"]
    assert out.getvalue() == "aé中\n"


def test_batch_streamer_rejects_batches():
    with pytest.raises(ValueError, match="batch size 1"):
        TextStreamer(byte_tokenizer()).put(np.zeros((2, 3), dtype=np.int64))


def test_text_streamer_stream_equals_output(backend):
    tok = byte_tokenizer()
    out = io.StringIO()
    model = backend.stub()
    result = backend.numpy(
        generate(
            model,
            [[5, 6, 7]],
            GenerationConfig(max_new_tokens=12, eos_token_id=None),
            streamer=TextStreamer(tok, skip_prompt=True, file=out),
        )
    )
    assert out.getvalue() == tok.decode(result[0, 3:].tolist()) + "\n"


def test_iterator_streamer_in_thread(backend):
    tok = byte_tokenizer()
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
    model = backend.stub()
    holder = {}
    cfg = GenerationConfig(max_new_tokens=10, eos_token_id=None, do_sample=True, seed=4)
    thread = generate_in_thread(lambda: holder.setdefault("out", generate(model, [[9, 8, 7]], cfg, streamer=streamer)))
    text = "".join(streamer)
    thread.join(60)
    assert text == tok.decode(backend.numpy(holder["out"])[0, 3:].tolist())


def test_hf_text_streamer_works_on_every_backend(backend, capsys):
    from transformers import PreTrainedTokenizerFast
    from transformers import TextStreamer as HFTextStreamer

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer())
    result = backend.numpy(
        generate(
            backend.stub(),
            [[5, 6, 7]],
            GenerationConfig(max_new_tokens=8, eos_token_id=None),
            streamer=HFTextStreamer(hf_tok, skip_prompt=True),
        )
    )
    assert capsys.readouterr().out == hf_tok.decode(result[0, 3:].tolist()) + "\n"
