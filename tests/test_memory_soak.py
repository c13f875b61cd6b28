"""Native memory over many calls (Issue 27): after a warm-up, RSS must stay flat over many
``generate`` calls (static and dynamic cache) and many in-flight engine requests, on MindSpore as
on torch. MindSpore 2.10's PyNative CPU kernels never free some host memory of most calls with a
scalar argument (docs/performance.md, "Issue 27"), so a MindSpore bound is what the ops we cannot
avoid still leave, well under what the old code grew.

Each job runs in its own process (a fresh heap), prints its growth per call, and is measured in two
halves: a cache that fills up (a per-shape constant, a graph per new shape) shows in the first half
only, a leak in both."""

import re
import subprocess
import sys

import pytest
from launch import REPO, _env

SOAK_JOB = r"""
import gc, sys
import numpy as np
import hyper_gen
from hyper_gen.demo import demo_model_path

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

backend, mode, warm, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = hyper_gen.load_model(demo_model_path(), backend=backend)
if backend == "mindspore":
    model.decode_compile_after = 2  # a dynamic cache's graphs compiled within the warm-up
if mode == "engine":
    from hyper_gen.engine import Engine, SamplingParams

    engine = Engine(model, None, max_batch_size=4).start(background=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    per_call = 4

    def call():
        prompts = [[int(t) for t in rng.integers(3, 90, int(rng.integers(3, 12)))] for _ in range(4)]
        streams = [engine.submit(prompt, params) for prompt in prompts]
        while engine.step():
            pass
        for stream in streams:
            stream.result()
else:
    ids, mask = [[5, 6, 7, 8, 9, 10], [0, 0, 7, 8, 9, 4]], [[1] * 6, [0, 0, 1, 1, 1, 1]]
    config = hyper_gen.GenerationConfig(max_new_tokens=12, eos_token_id=None, cache_implementation=mode)
    per_call = 1

    def call():
        hyper_gen.generate(model, ids, config, attention_mask=mask)

for _ in range(warm):
    call()
gc.collect()
marks = [rss_kb()]
for half in range(2):
    for _ in range(calls // 2):
        call()
    gc.collect()
    marks.append(rss_kb())
unit = per_call * (calls // 2)
print(f"growth_kb_per_call={(marks[2] - marks[0]) / (2 * unit):.2f} halves={(marks[1] - marks[0]) / unit:.2f},"
      f"{(marks[2] - marks[1]) / unit:.2f}", flush=True)
"""


def _growth(backend, mode, warm, calls):
    result = subprocess.run(
        [sys.executable, "-c", SOAK_JOB, backend, mode, str(warm), str(calls)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"growth_kb_per_call=([-\d.]+) halves=([-\d.]+),([-\d.]+)", result.stdout)
    assert found, result.stdout[-2000:] + result.stderr[-2000:]
    return float(found.group(1)), float(found.group(2)), float(found.group(3))


# KB of RSS one call may add after warm-up (a 12-token generate of the demo model; one 20-token
# engine request). Measured (docs/performance.md, "Issue 27"): MindSpore static ~79 before, ~40 after
# (what remains: the prefill's MatMuls, ~1.4 KB each, and the PyNative attention core, framework leaks
# without a leak-free kernel as fast); the engine 56-75 a request with this job's mix, up to ~180
# before the fix; torch grows nothing.
BOUNDS_KB = {
    ("mindspore", "static"): 60.0,
    ("mindspore", "dynamic"): 180.0,
    ("mindspore", "engine"): 110.0,
    ("torch", "static"): 2.0,
    ("torch", "dynamic"): 2.0,
    ("torch", "engine"): 2.0,
}
# besides, a half may grow the heap by one or two steps of 64 KB however flat the loop is (measured: torch
# static 3.2 KB a call over 20 calls, 0 over the other 20): allowed once a half, not once a call
HEAP_STEPS_KB = 128.0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mindspore", "torch"])
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_generate_memory_is_flat_over_many_calls(backend, mode):
    _, first, second = _growth(backend, mode, warm=8, calls=40)
    bound = BOUNDS_KB[(backend, mode)] + HEAP_STEPS_KB / 20
    # the second half: a leak shows in both halves, a cache filling up (or the heap's first pages) in the first
    assert second <= bound, f"{backend} {mode}: RSS grew {second:.1f} KB a generate call (halves {first}, {second})"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mindspore", "torch"])
def test_engine_memory_is_flat_over_many_requests(backend):
    _, first, second = _growth(backend, "engine", warm=20, calls=40)
    bound = BOUNDS_KB[(backend, "engine")] + HEAP_STEPS_KB / 80  # 20 rounds of 4 requests a half
    assert second <= bound, f"{backend} engine: RSS grew {second:.1f} KB a request (halves {first}, {second})"
