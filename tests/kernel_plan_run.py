"""One fresh process: load a checkpoint with ``kernels=``, greedy-generate from fixed prompts, and
print the sha256 of every step's logits, the tokens and the model's kernel plan as one JSON line
(tests/test_kernel_plan.py compares processes)."""

import hashlib
import json
import sys

import numpy as np

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.registry import to_host


def main(path: str, backend: str, kernels: str) -> None:
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
    print(
        json.dumps(
            {
                "logits": digest.hexdigest(),
                "tokens": np.asarray(to_host(out.sequences)).tolist(),
                "plan": model.kernel_plan.to_dict()["choices"],
                "mode": model.kernel_plan.mode,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
