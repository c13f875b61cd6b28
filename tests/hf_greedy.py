"""A native torch model's greedy tokens and logits against HF ``generate`` on the same tiny
checkpoint, on a left-padded batch: for the tests of the load-time projection choices, which must
leave what the model generates as HF's within float32 rounding."""

import numpy as np
import torch
from qwen_checkpoints import TINY_TEXT_CONFIG
from transformers import Qwen3_5ForCausalLM

from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate


def assert_generates_what_hf_does(model, path, new_tokens: int = 6):
    """Three rows of 9 tokens (two left-padded): the same greedy tokens as HF, every step's logits
    within 1e-4."""
    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(5)
    ids = torch.from_numpy(rng.integers(3, TINY_TEXT_CONFIG["vocab_size"], (3, 9)))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :2] = 0
    ids = ids * mask
    config = GenerationConfig(
        max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True
    )
    ours = generate(model, ids, config, attention_mask=mask)
    with torch.no_grad():
        theirs = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    pads = (mask == 0).sum(1)
    hf_rows = [theirs.sequences[i, int(pads[i]) :].tolist() for i in range(3)]  # HF's rows without padding
    assert [ours.sequences[i, : len(hf_rows[i])].tolist() for i in range(3)] == hf_rows
    for a, b in zip(ours.logits, theirs.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
