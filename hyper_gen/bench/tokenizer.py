"""A byte-level BPE tokenizer as wide as a bench checkpoint's vocabulary, for what needs real text tokens.

The random checkpoints have no tokenizer; structured outputs do need one, and the grammar library's
per-step work grows with the vocabulary's shape (its token trie), so a tokenizer of a few hundred
tokens would flatter it. This one is trained (``tokenizers``, once, then reused from the cache folder)
on the Python standard library's own sources: code, JSON-like punctuation and English, merges up to the
checkpoint's full vocabulary size.
"""

from __future__ import annotations

import glob
import os
import sysconfig


def bench_tokenizer(cache_dir: str, vocab_size: int):
    """An HF fast tokenizer with ``vocab_size`` ids (or as many merges as the corpus gives, if fewer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(cache_dir, f"bpe-{vocab_size}")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<pad>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        tokenizer.train(files, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
        fast.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


__all__ = ["bench_tokenizer"]
