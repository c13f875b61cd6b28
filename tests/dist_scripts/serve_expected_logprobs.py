"""Greedy token ids and their logprobs from plain ``hyper_gen.generate``, one prompt at a time.

stdin: {"backend", "model" (optional: a checkpoint folder, else the demo model), "prompts": [[ids...], ...],
"max_tokens", "ignore_eos"}; stdout: one JSON list of
{"tokens": generated ids (with the EOS that ended it), "logprobs": each one's logprob (the model's
distribution, ``raw_logprobs``)} per prompt. Run in its own process (one framework per process).
"""

import json
import sys

import numpy as np

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.demo import demo_model_path


def main():
    job = json.load(sys.stdin)
    model = load_model(job.get("model") or demo_model_path(), backend=job["backend"])
    eos = None if job.get("ignore_eos") else model.generation_defaults.get("eos_token_id", 1)
    config = GenerationConfig(max_new_tokens=job["max_tokens"], eos_token_id=eos, pad_token_id=0)
    out = []
    for ids in job["prompts"]:
        got = generate(
            model, np.asarray([ids], dtype=np.int64), config, return_dict_in_generate=True, output_logprobs=True
        )
        row = np.asarray(got.sequences.tolist())[0, len(ids) :].tolist()
        ended = next((i for i, t in enumerate(row) if eos is not None and t == eos), None)
        row = row[: ended + 1] if ended is not None else row[: job["max_tokens"]]
        logprobs = np.asarray(got.raw_logprobs.tolist(), dtype=np.float64)[0, : len(row)].tolist()
        out.append({"tokens": row, "logprobs": logprobs})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
