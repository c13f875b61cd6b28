"""One fresh process: load a checkpoint under each kernel mode given, greedy-generate from fixed
prompts, and print, as one JSON line ``{mode: result}``, each mode's sha256 of every step's logits,
the tokens and the model's kernel plan (tests/test_kernel_plan.py compares processes).

Modes: ``auto``; ``pinned``, the plan this process's ``auto`` load chose, written as a plan file
and loaded with ``kernels=<file>`` beside an empty cache folder (so nothing is read from the host's
plan); ``plain``. One process runs several modes: a framework's import is most of its time."""

import hashlib
import json
import os
import sys
import tempfile

import numpy as np

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.registry import to_host


def run(path: str, backend: str, kernels: str) -> dict:
    model = load_model(path, backend=backend, dtype="float32", kernels=kernels)
    ids = np.random.default_rng(4).integers(3, 97, (3, 24))
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # left padding: the packed prefill too
    config = GenerationConfig(
        max_new_tokens=6, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True
    )
    out = generate(model, ids * mask, config, attention_mask=mask)
    digest = hashlib.sha256()
    for step in out.logits:
        digest.update(np.ascontiguousarray(to_host(step), dtype=np.float32).tobytes())
    return {
        "logits": digest.hexdigest(),
        "tokens": np.asarray(to_host(out.sequences)).tolist(),
        "plan": model.kernel_plan.to_dict()["choices"],
        "mode": model.kernel_plan.mode,
    }


def main(path: str, backend: str, modes: str) -> None:
    results = {}
    for mode in modes.split(","):
        if mode == "pinned":
            scratch = tempfile.mkdtemp(prefix="kernel_plan_run-")
            plan = os.path.join(scratch, "plan.json")
            with open(plan, "w") as f:
                json.dump({"backend": backend, "choices": results["auto"]["plan"]}, f)
            os.environ["HYPER_GEN_CACHE_DIR"] = os.path.join(scratch, "empty-cache")
            results[mode] = run(path, backend, plan)
        else:
            results[mode] = run(path, backend, mode)
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:4])
