"""The bundled demo model solves its held-out task on torch and MindSpore, alone and in left-padded batches."""

import numpy as np
import pytest
from demo_task import DEMO_MODEL_DIR, is_correct, make_prompts
from transformers import AutoTokenizer

from hyper_gen import GenerationConfig, generate, load_model

PROMPTS = make_prompts(64, seed=2026)


def accuracy(backend, batch_size):
    model = load_model(DEMO_MODEL_DIR, backend=backend)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, padding_side="left")
    cfg = GenerationConfig(
        max_new_tokens=12,
        eos_token_id=model.generation_defaults["eos_token_id"],
        pad_token_id=model.generation_defaults["pad_token_id"],
    )
    correct = 0
    for start in range(0, len(PROMPTS), batch_size):
        prompts = [p for p, _ in PROMPTS[start : start + batch_size]]
        batch = tokenizer(prompts, padding=True, return_tensors="np")
        out = generate(model, batch["input_ids"], cfg, attention_mask=batch["attention_mask"])
        out = out.asnumpy() if hasattr(out, "asnumpy") else out.numpy()
        for prompt, row, length in zip(prompts, out, batch["attention_mask"].sum(1)):
            correct += is_correct(prompt, tokenizer.decode(row[length:], skip_special_tokens=True))
    return correct / len(PROMPTS)


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
@pytest.mark.parametrize("batch_size", [1, 32])
def test_demo_model_solves_heldout_prompts(backend, batch_size):
    assert accuracy(backend, batch_size) >= 0.95


def test_is_correct_rejects_wrong_answers():
    prompt, expected = PROMPTS[0]
    assert is_correct(prompt, expected) and not is_correct(prompt, expected + "1")
    assert np.unique([p for p, _ in PROMPTS]).size > 30
