"""What the server must answer, computed with plain ``hyper_gen.generate``, one prompt at a time.

stdin: {"backend", "prompts": [[ids...], ...], "max_tokens", optional "seed" (sampling with
vLLM's defaults: temperature 1, top_k / top_p off)}; stdout: one JSON list of generated token ids
per prompt, ending with the EOS that ended it. Run in its own process, so a test process never
imports a framework (MindSpore and torch each keep their own process).
"""

import json
import sys

import numpy as np

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.demo import demo_model_path


def main():
    job = json.load(sys.stdin)
    model = load_model(demo_model_path(), backend=job["backend"])
    eos = model.generation_defaults.get("eos_token_id", 1)
    config = GenerationConfig(max_new_tokens=job["max_tokens"], eos_token_id=eos, pad_token_id=0)
    if job.get("seed") is not None:
        config = config.replace(do_sample=True, seed=job["seed"], top_k=0, top_p=1.0, temperature=1.0)
    out = []
    for ids in job["prompts"]:
        row = np.asarray(generate(model, np.asarray([ids], dtype=np.int64), config).tolist())[0, len(ids) :].tolist()
        ended = next((i for i, t in enumerate(row) if t == eos), None)
        out.append(row[: ended + 1] if ended is not None else row[: job["max_tokens"]])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
