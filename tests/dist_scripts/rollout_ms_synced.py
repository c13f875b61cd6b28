"""Two msrun ranks, step-synced generate on a ZeRO-3-style MindSpore model (tests/zero3_mindspore.py).

Each rank has its own left-padded prompts (rank 0: 2 rows, rank 1: 3 rows of other widths), with
EOS (2) chosen so that rank 0's rows are all done after step 3 while rank 1 runs to step 11, and
checks, against the unsharded twin that every rank also holds:

- greedy: each rank's tokens equal the twin's on that rank's prompts;
- seeded sampling: each rank's rows equal the twin's run on the two ranks' prompts concatenated
  (the data-parallel row offset of the seeded noise);
- seeded with num_return_sequences=2 (each prompt prefilled once, its cache copied): the same;
- greedy and seeded again with unshard_params=True (the weights gathered once for the call);
- bad input on rank 1 only (a token id outside the vocabulary): both ranks raise before any forward;
- a logits processor raising on rank 1 at step 3: both ranks raise at that step;
- then greedy once more: the ranks' collectives are still paired after the failures.

Prints one ``ROLLOUT {json}`` line per check and rank; tests/test_rollout_mindspore.py asserts on
them. Nothing here asserts between collectives (a rank that stopped would hang the other): results
are reported, and every expectation is computed on every rank before the first sharded call.
"""

import json
import time
from collections import Counter

from zero3_mindspore import GREEDY, PROMPTS, SEEDED, VOCAB, UnshardedStubLM, Zero3StubLM, left_padded

from hyper_gen import generate
from hyper_gen.parallel.launcher import host_ops, init_distributed

assert init_distributed("mindspore")  # the collective timeout comes from $HYPER_GEN_TIMEOUT_S
ops = host_ops("mindspore")
rank, world = ops.rank(), ops.world_size()
assert world == 2, world


def report(check, **values):
    print("ROLLOUT " + json.dumps(dict(rank=rank, check=check, **values)), flush=True)


twin = UnshardedStubLM()
model = Zero3StubLM(rank, world)
IDS, MASK = left_padded(PROMPTS[rank])
ALL_IDS, ALL_MASK = left_padded(PROMPTS[0] + PROMPTS[1])
FIRST = len(PROMPTS[0]) if rank else 0  # this rank's first prompt in the concatenated batch
SAMPLES = SEEDED.replace(num_return_sequences=2)  # GRPO-style: 2 samples per prompt


def twin_rows(config):
    """(this rank's prompts run alone, this rank's rows of the concatenated run) on the twin."""
    n = config.num_return_sequences
    alone = generate(twin, IDS, config, attention_mask=MASK).asnumpy()
    together = generate(twin, ALL_IDS, config, attention_mask=ALL_MASK).asnumpy()
    return alone.tolist(), together[n * FIRST : n * (FIRST + len(PROMPTS[rank]))].tolist()


# every expectation first, the same work on every rank (no rank waits long for the other later)
CONFIGS = {"greedy": GREEDY, "seeded": SEEDED, "samples": SAMPLES}
EXPECTED = {name: twin_rows(config) for name, config in CONFIGS.items()}
twin.calls.clear()


def sharded_run(check, expected, config):
    model.calls.clear()
    model.gathers = 0
    start = time.monotonic()
    out = generate(model, IDS, config, attention_mask=MASK)
    elapsed = time.monotonic() - start
    alone, together = EXPECTED[expected]
    report(
        check,
        tokens=out.asnumpy().tolist(),
        alone=alone,
        together=together,
        calls=dict(Counter(model.calls)),
        order=model.calls,
        gathers=model.gathers,
        weights=len(model.names),
        seconds=round(elapsed, 3),
    )


for name, config in CONFIGS.items():
    sharded_run(name, name, config)
sharded_run("greedy-unshard", "greedy", GREEDY.replace(unshard_params=True))
sharded_run("seeded-unshard", "seeded", SEEDED.replace(unshard_params=True))


def failing_run(check, ids, mask, config):
    model.calls.clear()
    model.gathers = 0
    start = time.monotonic()
    try:
        generate(model, ids, config, attention_mask=mask)
        error = None
    except Exception as exc:  # noqa: BLE001 - what each rank raises is the finding
        error = exc
    report(
        check,
        error_type=None if error is None else type(error).__name__,
        is_value_error=isinstance(error, ValueError),
        message=None if error is None else str(error),
        calls=dict(Counter(model.calls)),
        gathers=model.gathers,
        seconds=round(time.monotonic() - start, 3),
    )


# rank 1 only: a token id outside the model's declared vocabulary
bad = IDS.copy()
if rank == 1:
    bad[1, -1] = VOCAB + 5
failing_run("bad-token", bad, MASK, GREEDY)


class RaiseAt:
    """A logits processor that raises on rank 1 at its 4th call (step 3), else passes scores on."""

    def __init__(self):
        self.seen = 0

    def __call__(self, input_ids, scores):
        self.seen += 1
        if rank == 1 and self.seen == 4:
            raise ValueError("rank 1's logits processor gave up at step 3")
        return scores


failing_run("processor-raises", IDS, MASK, GREEDY.replace(logits_processor=[RaiseAt()]))
sharded_run("greedy-after-errors", "greedy", GREEDY)
print(f"rank {rank}: done", flush=True)
