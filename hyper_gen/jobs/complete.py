"""One batch of text prompts completed through ``generate``: the texts, token counts and finish
reasons that the CLI prints and the JSONL runner writes. A finish reason is the engine's and the
server's word (OpenAI's): "stop" (an EOS id ended the row) or "length" (it ran out of tokens)."""

from __future__ import annotations

import numpy as np

from hyper_gen.generation import generate
from hyper_gen.registry import to_host


def host(tensor):
    """A framework tensor (generate's output) as a numpy array."""
    return np.asarray(to_host(tensor))


def completions(model, tokenizer, prompts, config, on_tokens=None):
    """(completion texts, generated token counts, finish reasons) for a left-padded batch of prompts."""
    batch = tokenizer(prompts, padding=True, return_tensors="np", add_special_tokens=False)
    mask = batch["attention_mask"]
    out = host(generate(model, batch["input_ids"], config, attention_mask=mask, on_tokens=on_tokens))
    texts, counts, reasons = [], [], []
    eos = set(config.eos_token_ids)
    for row, length in enumerate(mask.sum(axis=1)):
        generated = out[row, int(length) :].tolist()
        ended = next((i for i, t in enumerate(generated) if t in eos), None)
        generated = generated[: ended + 1] if ended is not None else generated
        if ended is None:  # trailing pad ids only pad the output to the common width
            generated = generated[: config.max_new_tokens]
        texts.append(tokenizer.decode(generated, skip_special_tokens=True))
        counts.append(len(generated))
        reasons.append("stop" if ended is not None else "length")
    return texts, counts, reasons
