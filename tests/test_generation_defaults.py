"""generate() takes the model's own generation settings as HF does: explicit arguments > the
passed config's explicitly set fields > the model's generation_config (HF) or the checkpoint's
generation_config.json (native) > the RFC defaults."""

import warnings

import numpy as np
import pytest
import torch
import transformers
from demo_task import DEMO_MODEL_DIR

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.config import model_defaults, resolve_config

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*fall(ing)? back.*")

PROMPTS = ["rev 12345 =", "rev 908 =", "rev 7 ="]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, padding_side="left")


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def _batch(tokenizer):
    return tokenizer(PROMPTS, padding=True, return_tensors="np")


def test_hf_model_with_no_eos_or_pad_passed_equals_hf_generate(tokenizer, hf_model):
    batch = _batch(tokenizer)
    ids, mask = torch.from_numpy(batch["input_ids"]), torch.from_numpy(batch["attention_mask"])
    expected = hf_model.generate(ids, attention_mask=mask, max_new_tokens=12)
    ours = generate(hf_model, ids, attention_mask=mask, max_new_tokens=12)
    # HF keeps the left padding; we return [prompt | generated | pad]: compare the continuations
    width = ids.shape[1]
    for row in range(len(PROMPTS)):
        real = int(mask[row].sum())
        theirs = expected[row, width:].tolist()
        assert ours[row, real : real + len(theirs)].tolist() == theirs
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in ours.tolist()]
    assert texts == ["rev 12345 = 54321", "rev 908 = 809", "rev 7 = 7"]


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_native_model_stops_at_its_checkpoint_eos(tokenizer, backend):
    model = load_model(DEMO_MODEL_DIR, backend=backend)
    batch = _batch(tokenizer)
    out = generate(
        model, batch["input_ids"], GenerationConfig(max_new_tokens=12), attention_mask=batch["attention_mask"]
    )
    out = np.asarray(out.tolist())
    eos = model.generation_defaults["eos_token_id"]
    assert eos == 1
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in out.tolist()]
    assert texts == ["rev 12345 = 54321", "rev 908 = 809", "rev 7 = 7"]
    # every row ends at its EOS, then pads: nothing generated past the answer
    for row in out:
        after = row[list(row).index(eos) + 1 :]
        assert set(after.tolist()) <= {model.generation_defaults["pad_token_id"]}


class _Model:
    generation_defaults = {"eos_token_id": 7, "pad_token_id": 5, "top_k": 3, "bos_token_id": 9}


def test_precedence_override_over_config_over_model_over_defaults():
    model = _Model()
    assert resolve_config(None, {}, model).eos_token_id == 7
    assert resolve_config(None, {}, model).top_k == 3
    assert resolve_config(None, {}, model).max_new_tokens == GenerationConfig().max_new_tokens
    config = GenerationConfig(eos_token_id=2, max_new_tokens=4)
    resolved = resolve_config(config, {}, model)
    assert (resolved.eos_token_id, resolved.pad_token_id, resolved.max_new_tokens) == (2, 5, 4)
    assert resolve_config(config, {"eos_token_id": None}, model).eos_token_id is None
    # a field set through replace() counts as explicit too
    assert resolve_config(GenerationConfig().replace(top_k=0), {}, model).top_k == 0
    # no model settings: the RFC defaults
    assert resolve_config(None, {}, object()).eos_token_id == 2


def test_pad_defaults_to_the_first_eos_when_the_model_names_none():
    class Model:
        generation_defaults = {"eos_token_id": [4, 6]}

    assert model_defaults(Model())["pad_token_id"] == 4


def test_invalid_model_settings_are_named():
    class Model:
        generation_defaults = {"top_p": 3.0}

    with pytest.raises(ValueError, match="model's generation settings.*top_p"):
        resolve_config(None, {}, Model())
