"""Structured outputs in Python, torch and MindSpore: ``generate(..., structured_outputs=...)`` and the
engine's ``SamplingParams(structured_outputs=...)`` give the same tokens, whatever grammars share a batch.

A grammar that admits every token the demo model would choose leaves greedy tokens unchanged; a JSON
schema, a regex and a choice list hold every output to them; the in-flight engine with rows of
different grammars (and free rows, n choices, seeded sampling) gives each request what it gives it alone,
and what generate() gives its prompt.
"""

import json
import re

import numpy as np
import pytest
from demo_task import DEMO_MODEL_DIR
from transformers import AutoTokenizer

from hyper_gen import StructuredOutputs, generate, load_model
from hyper_gen.engine import Engine, SamplingParams

BACKENDS = ["torch", "mindspore"]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["rev 12345 =", "rev 908 =", "rev 70 ="]
SPECS = [
    {"json": SCHEMA},
    {"regex": "[0-9]{2,4} (yes|no)"},
    {"choice": ["left", "right", "rev"]},
    None,
]
_MODELS = {}


def demo(backend):
    if backend not in _MODELS:
        _MODELS[backend] = load_model(DEMO_MODEL_DIR, backend=backend)
    return _MODELS[backend]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, padding_side="left")


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.numpy()


def new_tokens(tokenizer, out, prompt):
    """One row's generated ids (up to and with its EOS; no padding)."""
    row = [t for t in out[len(prompt) :] if t != tokenizer.pad_token_id]
    eos = tokenizer.eos_token_id
    return row[: row.index(eos) + 1] if eos in row else row


def alone(model, tokenizer, prompt, spec, max_new_tokens, **overrides):
    ids = tokenizer(prompt)["input_ids"]
    out = generate(
        model, [ids], max_new_tokens=max_new_tokens, tokenizer=tokenizer, structured_outputs=spec, **overrides
    )
    return [new_tokens(tokenizer, row.tolist(), ids) for row in host(out)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grammar_admitting_the_models_tokens_changes_nothing(backend, tokenizer):
    model = demo(backend)
    batch = tokenizer(PROMPTS, padding=True, return_tensors="np")
    free = host(generate(model, batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=10))
    for spec in ({"lark": "start: /(.|\\n)*/"}, {"regex": "[0-9 ]*"}):
        out = generate(
            model,
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=10,
            tokenizer=tokenizer,
            structured_outputs=spec,
        )
        np.testing.assert_array_equal(host(out), free)


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_holds_each_prompt_to_its_grammar(backend, tokenizer):
    model = demo(backend)
    batch = tokenizer(PROMPTS, padding=True, return_tensors="np")
    specs = [SPECS[0], SPECS[1], SPECS[2]]
    out = generate(
        model,
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=40,
        tokenizer=tokenizer,
        structured_outputs=specs,
        do_sample=True,
        seed=3,
        num_return_sequences=2,
    )
    lengths = np.repeat(batch["attention_mask"].sum(1), 2)  # rows: [prompt without padding | new | pad]
    rows = [new_tokens(tokenizer, row.tolist(), range(n)) for row, n in zip(host(out), lengths)]
    for i, text in enumerate(tokenizer.batch_decode(rows, skip_special_tokens=True)):
        kind = i // 2
        if kind == 0:
            value = json.loads(text)
            assert set(value) == {"answer", "ok"} and isinstance(value["answer"], int), text
            assert isinstance(value["ok"], bool), text
        elif kind == 1:
            assert re.fullmatch("[0-9]{2,4} (yes|no)", text), text
        else:
            assert text in ("left", "right", "rev"), text
    # the first prompt's rows are what it gives alone with the same seed (generate's seeded draws are keyed
    # by row, as HF's are: the other prompts' rows would draw with their own keys alone)
    expected = alone(model, tokenizer, PROMPTS[0], specs[0], 40, do_sample=True, seed=3, num_return_sequences=2)
    assert rows[:2] == expected


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engine_with_mixed_grammars_equals_one_request_at_a_time(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    cases = []
    for p, prompt in enumerate(PROMPTS):
        for spec in SPECS:
            cases.append((prompt, spec, SamplingParams(max_tokens=20, temperature=0, structured_outputs=spec)))
            cases.append(
                (prompt, spec, SamplingParams(max_tokens=20, temperature=0.9, n=2, seed=p, structured_outputs=spec))
            )
    ids = {prompt: tokenizer(prompt)["input_ids"] for prompt in PROMPTS}
    with Engine(model, tokenizer, max_num_seqs=8) as engine:
        together = [engine.submit(ids[prompt], params) for prompt, _, params in cases]
        together = [[c.token_ids for c in s.result(timeout=300).outputs] for s in together]
        one_by_one = [
            [c.token_ids for c in engine.submit(ids[prompt], params).result(timeout=300).outputs]
            for prompt, _, params in cases
        ]
    assert together == one_by_one
    for (prompt, spec, params), choices in zip(cases, together):
        if params.temperature == 0:  # greedy: generate()'s tokens under the same grammar
            assert choices == alone(model, tokenizer, prompt, spec, 20)
        else:  # seeded: generate(..., seed=s)'s, choice i its row i
            assert choices == alone(
                model,
                tokenizer,
                prompt,
                spec,
                20,
                do_sample=True,
                temperature=0.9,
                seed=params.seed,
                num_return_sequences=2,
            )


def test_bad_structured_outputs_are_refused_before_any_forward(tokenizer):
    model = demo("torch")
    ids = [tokenizer("rev 1 =")["input_ids"]]
    with pytest.raises(ValueError, match="tokenizer="):
        generate(model, ids, max_new_tokens=2, structured_outputs={"json": SCHEMA})
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        generate(model, ids, max_new_tokens=2, tokenizer=tokenizer, structured_outputs=[SPECS[0], SPECS[1]])
    with pytest.raises(ValueError, match="grammar library rejects"):
        generate(model, ids, max_new_tokens=2, tokenizer=tokenizer, structured_outputs={"regex": "(unclosed"})
    with pytest.raises(ValueError, match="exactly one of"):
        generate(model, ids, max_new_tokens=2, tokenizer=tokenizer, structured_outputs={"regex": "a", "json": SCHEMA})
    with pytest.raises(TypeError, match="structured_outputs must be"):
        generate(model, ids, max_new_tokens=2, tokenizer=tokenizer, structured_outputs="json")
    assert StructuredOutputs.of({"choice": ["a"]}).choice == ["a"]
