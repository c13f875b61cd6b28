"""MindSpore's compiled one-token blocks (opt-in, ``HYPER_GEN_MINDSPORE_JIT=1``) give the tokens and
float64 logits PyNative gives for the same batch: the switch is read at import, so the compiled run
is its own process."""

import json
import subprocess
import sys

import numpy as np
from launch import REPO, _env

SCRIPT = r"""
import json, sys
import numpy as np
from hyper_gen import generate, load_model
from hyper_gen.demo import demo_model_path
from hyper_gen.backends.mindspore.models import qwen3_5
model = load_model(demo_model_path(), backend="mindspore", dtype="float64")
ids = np.array([[0, 0, 85, 72, 89, 3, 20, 21, 22, 32], [85, 72, 89, 3, 24, 23, 22, 21, 20, 32]])
mask = (np.arange(10)[None, :] >= np.array([[2], [0]])).astype(np.int64)
out = generate(model, ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True, output_logits=True)
print(json.dumps({"compiled": qwen3_5.COMPILED_DECODE, "tokens": out.sequences.asnumpy().tolist(),
                  "logits": [l.asnumpy().astype(float).tolist() for l in out.logits]}))
"""


def _run(compiled: bool):
    env = dict(_env(), HYPER_GEN_MINDSPORE_JIT="1" if compiled else "0")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_compiled_decode_equals_pynative():
    compiled, pynative = _run(True), _run(False)
    assert compiled["compiled"] is True and pynative["compiled"] is False
    assert compiled["tokens"] == pynative["tokens"]
    difference = np.abs(np.array(compiled["logits"]) - np.array(pynative["logits"])).max()
    assert difference < 1e-9, difference
