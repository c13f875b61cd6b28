"""Rollout outputs from a native tensor-parallel model: n samples, logprobs, scores and stop strings.

Run with ``tp`` and ``backend`` as arguments (``tp=1`` in one process is the reference); rank 0
prints one JSON line ``RESULT {...}`` with the sequences and float64 logprobs.
"""

import json
import os
import sys

import numpy as np

tp, backend = int(sys.argv[1]), sys.argv[2]
if backend == "mindspore":
    import mindspore

    mindspore.set_device("CPU")
else:
    import torch

    torch.set_num_threads(1)
from transformers import AutoTokenizer  # noqa: E402

from hyper_gen import generate, load_model  # noqa: E402
from hyper_gen.demo import demo_model_path  # noqa: E402

model = load_model(demo_model_path(), backend=backend, tp=tp, dtype="float64")
ids = np.array([[0, 0, 85, 72, 89, 3, 20, 21, 22, 32], [85, 72, 89, 3, 24, 23, 22, 21, 20, 32]])
mask = (np.arange(10)[None, :] >= np.array([[2], [0]])).astype(np.int64)
out = generate(
    model,
    ids,
    attention_mask=mask,
    max_new_tokens=8,
    do_sample=True,
    seed=5,
    temperature=4.0,
    num_return_sequences=3,
    return_dict_in_generate=True,
    output_logprobs=True,
    output_scores=True,
    stop_strings=["0"],
    tokenizer=AutoTokenizer.from_pretrained(demo_model_path()),
)


def host(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else x.numpy()


if int(os.environ.get("RANK", os.environ.get("MS_NODE_ID", "0"))) == 0:
    result = {
        "sequences": host(out.sequences).tolist(),
        "logprobs": host(out.logprobs).tolist(),
        "raw_logprobs": host(out.raw_logprobs).tolist(),
        "scores": len(out.scores),
        "generated": out.generated_lengths.tolist(),
    }
    print("RESULT " + json.dumps(result), flush=True)
