"""What the server must answer, computed with plain ``hyper_gen.generate``, one prompt at a time.

stdin: {"backend", "prompts": [[ids...], ...], "max_tokens", optional "seed" (sampling with
vLLM's defaults: temperature 1, top_k / top_p off)}; stdout: one JSON list of generated token ids
per prompt, ending with the EOS that ended it. The server tests call ``expected`` in their own process
(a fresh process per reference paid 10-30 s of framework imports on 2 cores); the demo model is
loaded once per backend.
"""

import functools
import json
import sys

import numpy as np

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.demo import demo_model_path


@functools.lru_cache(maxsize=None)
def _model(backend):
    return load_model(demo_model_path(), backend=backend)


def expected(backend, prompts, max_tokens, seed=None):
    """Generated token ids per prompt (lists), each ending with the EOS that ended it."""
    model = _model(backend)
    eos = model.generation_defaults.get("eos_token_id", 1)
    config = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=0)
    if seed is not None:
        config = config.replace(do_sample=True, seed=seed, top_k=0, top_p=1.0, temperature=1.0)
    out = []
    for ids in prompts:
        row = np.asarray(generate(model, np.asarray([ids], dtype=np.int64), config).tolist())[0, len(ids) :].tolist()
        ended = next((i for i, t in enumerate(row) if t == eos), None)
        out.append(row[: ended + 1] if ended is not None else row[:max_tokens])
    return out


def main():
    job = json.load(sys.stdin)
    print(json.dumps(expected(job["backend"], job["prompts"], job["max_tokens"], job.get("seed"))))


if __name__ == "__main__":
    main()
