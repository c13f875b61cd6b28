"""Incremental detokenization: the streamed text equals the full decode for byte-level BPE,
SentencePiece-style (Metaspace, byte fallback), WordPiece with the clean-up of tokenization spaces
and the demo model's tokenizer, on random id streams with multi-byte characters and special tokens;
stop strings cut it exactly; and the ids decoded grow linearly with the stream, not quadratically."""

import numpy as np
import pytest
from test_engine_robustness import hf_bytes
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from hyper_gen.engine.detokenize import IncrementalText, fast_decoder

WORDS = ["hello", "a", "ab", "é", "naïve", "中文", "测试", "🙂", "x.", "?", "don't", "'s", "Ωmega", "\n", "  "]


def byte_level():
    tok = hf_bytes()
    tok.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    return tok


def demo():
    from transformers import AutoTokenizer

    from hyper_gen.demo import demo_model_path

    return AutoTokenizer.from_pretrained(demo_model_path())


def metaspace_unigram():
    """A SentencePiece-style Unigram, trained here: a decode drops the leading space of its first token."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [" ".join(WORDS), "hello naïve world", "中文 测试 hello", "a b ab abab hello world"] * 4
    trainer = trainers.UnigramTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>")
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def llama_style():
    """A Llama-style BPE: Metaspace normalizer, byte fallback for characters outside the vocabulary,
    and the decoder that strips the leading space once."""
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + list("abdehlnotx.?'")
    pieces += ["▁a", "ab", "▁ab", "he", "ll", "hell", "hello", "▁hello"]
    merges = [("▁", "a"), ("a", "b"), ("▁a", "b"), ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def wordpiece_clean_up():
    """WordPiece, whose decode joins tokens with spaces that the clean-up then removes before "." or "'s"."""
    from transformers import PreTrainedTokenizerFast

    pieces = ["[UNK]", "[CLS]", "[SEP]", "x", "y", "##x", "##s", ".", "?", "!", ",", "'", "n't", "'m", "'s"]
    pieces += ["'ve", "'re", "n", "t", "m", "s", "ve", "re", "é", "中"]
    tok = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # the clean-up under test is transformers', on the text
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", clean_up_tokenization_spaces=True
    )


TOKENIZERS = {
    "byte_level": byte_level,
    "demo": demo,
    "metaspace_unigram": metaspace_unigram,
    "llama_style": llama_style,
    "wordpiece_clean_up": wordpiece_clean_up,
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    return request.param, TOKENIZERS[request.param]()


def random_ids(name, tok, rng, length):
    """Ids a model could sample: encoded words (multi-byte characters spread over several tokens),
    random ids of the vocabulary, special tokens and ids past the tokenizer's vocabulary (a model's
    padded embedding rows, which decode drops), in random order. The byte-fallback tokenizer
    gets no random byte tokens: an invalid byte group decodes as one U+FFFD per byte, which a later
    byte can turn back into text, so no stream of it can be exact."""
    special = sorted(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if not (name == "llama_style" and 3 <= i < 259)]
    ids = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.5:
            ids += tok(" " + str(rng.choice(WORDS)), add_special_tokens=False)["input_ids"]
        elif kind < 0.85:
            ids.append(int(rng.choice(vocab)))
        elif kind < 0.95 and special:
            ids.append(int(rng.choice(special)))
        else:
            ids.append(len(tok) + int(rng.integers(0, 8)))
    return ids[:length]


def stream(tok, ids, stops, decode=None):
    """(the deltas of update, one per id, up to a stop; finish(); the IncrementalText)."""
    text = IncrementalText(tok, stops, decode=decode)
    deltas, so_far = [], []
    for token in ids:
        so_far.append(token)  # one list, growing, as the engine passes a choice's ids
        delta, stopped = text.update(so_far)
        deltas.append(delta)
        if stopped:
            break
    return deltas, text.finish(), text


@pytest.mark.parametrize("seed", range(4))
def test_the_stream_adds_up_to_the_full_decode(tokenizer, seed):
    name, tok = tokenizer
    rng = np.random.default_rng(seed)
    ids = random_ids(name, tok, rng, 400)
    full = tok.decode(ids, skip_special_tokens=True)
    deltas, last, text = stream(tok, ids, [])
    assert "".join(deltas) + last == full == text.text
    assert text.emitted == len(full)
    assert not any(d.endswith("\ufffd") for d in deltas), "a character whose bytes had not all arrived went out"


@pytest.mark.parametrize("seed", range(4))
def test_a_stop_string_cuts_the_full_decode_at_its_first_occurrence(tokenizer, seed):
    name, tok = tokenizer
    rng = np.random.default_rng(100 + seed)
    ids = random_ids(name, tok, rng, 400)
    full = tok.decode(ids, skip_special_tokens=True)
    start = int(rng.integers(len(full) // 4, len(full) // 2))
    found = full[start : start + int(rng.integers(1, 5))]
    absent = next(s for s in ("§¤", "¤§¤", "§§§§§§") if s not in full)
    for stops in ([found], [absent, found], [absent]):
        expected = full[: min((full.find(s) for s in stops if s in full), default=len(full))]
        deltas, last, text = stream(tok, ids, stops)
        assert "".join(deltas) + last == expected == text.text, stops


def test_fast_decoder_matches_the_tokenizers_decode(tokenizer):
    name, tok = tokenizer
    ids = random_ids(name, tok, np.random.default_rng(7), 200)
    assert fast_decoder(tok)(ids) == tok.decode(ids, skip_special_tokens=True)


def test_no_tokenizer_no_text():
    text = IncrementalText(None, ["x"])
    assert text.update([1, 2]) == ("", False) and text.finish() == "" and text.text == ""


def counted_stream(length):
    """Ids decoded per token of a ``length``-token byte-level stream (a counting decode)."""
    tok = byte_level()
    ids = random_ids("byte_level", tok, np.random.default_rng(0), length)
    backend, decoded = tok.backend_tokenizer, [0]

    def decode(window):
        decoded[0] += len(window)
        return backend.decode(window, skip_special_tokens=True)

    deltas, last, _ = stream(tok, ids, ["</answer>"], decode=decode)
    assert "".join(deltas) + last == tok.decode(ids, skip_special_tokens=True)
    return decoded[0] / length


def test_a_run_of_special_tokens_is_not_decoded_again_each_step():
    tok = byte_level()
    special = tok.convert_tokens_to_ids("<|end|>")
    ids = tok("héllo", add_special_tokens=False)["input_ids"] + [special] * 2000 + tok(" 中文")["input_ids"]
    decoded = []

    def decode(window):
        decoded.append(len(window))
        return tok.decode(window, skip_special_tokens=True)

    deltas, last, _ = stream(tok, ids, [], decode=decode)
    assert "".join(deltas) + last == "héllo 中文"
    assert sum(decoded) <= 16 * len(ids), sum(decoded)


def test_ids_decoded_per_token_do_not_grow_with_the_stream():
    """Each step decodes a window of a few ids, not the whole prefix: a 16k-token rollout decodes
    O(length) ids in all (re-decoding the prefix each step would be ~8k ids per token)."""
    short, long = counted_stream(256), counted_stream(16384)
    assert long <= 16, long
    assert long <= 1.2 * short, (short, long)
