"""Native memory over many calls (Issue 27): after a warm-up, RSS must stay flat over many
``generate`` calls (static and dynamic cache) and many in-flight engine requests, on MindSpore as
on torch. MindSpore 2.10's PyNative CPU kernels never free some host memory of most calls with a
scalar argument (docs/performance.md, "Issue 27"), so a MindSpore bound is what the ops we cannot
avoid still leave, well under what the old code grew.

Each job runs in its own process (a fresh heap), prints its growth per call, and is measured in four
quarters: a cache that fills up (a per-shape constant, a graph per new shape) shows in the first
quarter only, the allocator growing its heap by a step (glibc arenas, the mmap threshold moving; up to
~1 MB at once, measured in CI on a torch loop that grows nothing else) in one quarter, a leak in every
quarter. The bound applies to the flattest of the last three quarters: a leak cannot pass it, a
single heap step cannot fail it."""

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
for quarter in range(4):
    for _ in range(calls // 4):
        call()
    gc.collect()
    marks.append(rss_kb())
unit = per_call * (calls // 4)
quarters = ",".join(f"{(b - a) / unit:.2f}" for a, b in zip(marks, marks[1:]))
print(f"growth_kb_per_call={(marks[-1] - marks[0]) / (4 * unit):.2f} quarters={quarters}", flush=True)
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
    found = re.search(r"growth_kb_per_call=([-\d.]+) quarters=([-\d.,]+)", result.stdout)
    assert found, result.stdout[-2000:] + result.stderr[-2000:]
    quarters = [float(q) for q in found.group(2).split(",")]
    assert len(quarters) == 4, found.group(0)
    return float(found.group(1)), quarters


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


def _flattest_late_quarter(quarters):
    """What a leak adds in every quarter; the first quarter holds the caches filling up."""
    return min(quarters[1:])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mindspore", "torch"])
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_generate_memory_is_flat_over_many_calls(backend, mode):
    _, quarters = _growth(backend, mode, warm=8, calls=40)
    growth = _flattest_late_quarter(quarters)
    assert growth <= BOUNDS_KB[(backend, mode)], (
        f"{backend} {mode}: RSS grew {growth:.1f} KB a generate call in every late quarter (quarters {quarters})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mindspore", "torch"])
def test_engine_memory_is_flat_over_many_requests(backend):
    _, quarters = _growth(backend, "engine", warm=20, calls=40)  # 10 rounds of 4 requests a quarter
    growth = _flattest_late_quarter(quarters)
    assert growth <= BOUNDS_KB[(backend, "engine")], (
        f"{backend} engine: RSS grew {growth:.1f} KB a request in every late quarter (quarters {quarters})"
    )
