"""The engine's scheduler: no mix of requests wedges it, and a step runs once per forward it plans.

The first tests drive ``Scheduler`` alone (host bookkeeping, no model): random mixes of prompts, n
choices, pools and budgets all finish, every step computes within its budget and the pool, and a
sequence's positions are computed once each between preemptions. The last one runs the case that
wedged the engine before the scheduler was one loop (two prompts that each fit the pool alone,
prefilled side by side until the pool was full) on torch and MindSpore: both requests and a later
one finish with generate()'s tokens.
"""

import dataclasses

import numpy as np
import pytest
from qwen_checkpoints import make_checkpoint

from hyper_gen import generate, load_model, score
from hyper_gen.engine import Engine, SamplingParams
from hyper_gen.engine.request import Request
from hyper_gen.engine.scheduler import Scheduler, SchedulerOutput
from hyper_gen.kv_cache import KVCacheManager

VOCAB = 97


def _requests(rng, count, longest):
    out = []
    for serial in range(count):
        params = SamplingParams(max_tokens=int(rng.integers(1, 12)), n=int(rng.choice([1, 1, 2, 3])))
        prompt = rng.integers(8, VOCAB, int(rng.integers(1, longest))).tolist()
        request = Request(serial, f"r{serial}", prompt, params, 0)
        request.open_choices([])
        out.append(request)
    return out


def _run(scheduler, requests, rng, max_steps=5000):
    """Step the scheduler as the engine does (the runner's draws made up); the steps taken."""
    for request in requests:
        scheduler.add(request)
    computed = {}  # key -> positions computed since its sequence was (re)started
    announced = set()  # serials the runners were told of: once each, preempted or not
    budget = scheduler.max_num_batched_tokens
    for step in range(max_steps):
        drops = [c.key for r in requests for c in r.choices if len(c.token_ids) >= r.params.max_tokens]
        scheduler.drop(drops)
        if not len(scheduler):
            return step
        out = scheduler.schedule()
        out = SchedulerOutput.decode(out.encode())  # what the other ranks get
        assert not out.empty, "the scheduler has work but scheduled nothing: wedged"
        assert announced.isdisjoint(out.new_requests), out.new_requests
        announced.update(out.new_requests)
        for parent, children in out.forks:  # (the runner's order: forks, then frees)
            for child, _ in children:
                computed[child] = computed[parent]
        for key in out.freed:
            computed.pop(key, None)
        prefill_tokens = sum(item.count for item in out.prefills)
        assert prefill_tokens <= max(budget - len(out.decodes), 1)
        assert scheduler.kv.pool.num_used <= scheduler.kv.num_blocks
        assert scheduler.num_running_choices() <= scheduler.max_num_seqs
        for item in out.decodes + out.prefills:
            assert item.start == computed.get(item.key, item.start if item.blocks else -1)
            computed[item.key] = item.start + item.count
            if item.sample:
                request = requests[item.key[0]]
                choices = request.choices if item.key[1] < 0 else [request.choices[item.key[1]]]
                for choice in choices:
                    choice.token_ids.append(int(rng.integers(8, VOCAB)))
        scheduler.update(out, {item.key for item in out.decodes + out.prefills})
    raise AssertionError(f"not done after {max_steps} steps: wedged")


@pytest.mark.parametrize("seed", range(40))
def test_no_mix_of_requests_wedges_the_scheduler(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 2, 4, 16]))
    hybrid = bool(rng.integers(2))
    longest = int(rng.integers(2, 120))
    requests = _requests(rng, int(rng.integers(1, 12)), longest)
    # the pool holds the largest request alone (the engine refuses one that does not), rarely more
    need = max(-(-(len(r.prompt) + r.params.max_tokens) // block_size) * r.params.n for r in requests)
    kv = KVCacheManager(
        need + int(rng.integers(0, need + 1)),
        block_size,
        enable_prefix_caching=bool(rng.integers(2)),
        state_snapshot_blocks=int(rng.integers(1, 4)),
        hybrid=hybrid,
    )
    scheduler = Scheduler(kv, max_num_seqs=int(rng.integers(3, 9)), max_num_batched_tokens=int(rng.integers(1, 64)))
    steps = _run(scheduler, requests, rng)
    assert all(len(c.token_ids) == r.params.max_tokens for r in requests for c in r.choices)
    assert steps > 0 and kv.pool.num_used == 0
    assert not scheduler._seen  # issue 48: its bookkeeping is bounded by what is in flight


def test_two_prompts_that_fill_the_pool_together_both_finish():
    """Each fits the pool alone, not both: the older preempts the younger instead of both stopping half way."""
    rng = np.random.default_rng(0)
    requests = []
    for serial in range(3):
        request = Request(serial, f"r{serial}", rng.integers(8, VOCAB, 300).tolist(), SamplingParams(max_tokens=8), 0)
        request.open_choices([])
        requests.append(request)
    kv = KVCacheManager(20, 16, enable_prefix_caching=True, hybrid=True)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    _run(scheduler, requests, rng)
    assert scheduler.preemptions > 0
    assert all(len(r.choices[0].token_ids) == 8 for r in requests)


def _host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.detach().numpy()


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_the_engine_finishes_two_prompts_that_fill_its_pool_together(tmp_path, backend, one_torch_thread):
    model = load_model(make_checkpoint(tmp_path, "dense", "float32"), backend=backend)
    probe = Engine(model, block_size=16).stats()
    budget = 30 * probe["bytes_per_block"] + probe["state_slot_bytes"]  # (the live Gated DeltaNet states' slots)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(8, VOCAB, n).tolist() for n in (300, 300, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with Engine(model, block_size=16, cache_memory_bytes=budget, max_num_batched_tokens=100) as engine:
        blocks = engine.stats()["blocks_total"]
        assert 20 <= blocks < 40, blocks  # 308 positions (20 blocks) fit alone, two do not
        first = [engine.submit(p, params) for p in prompts[:2]]
        outs = [s.result(timeout=120) for s in first]
        later = engine.submit(prompts[2], params).result(timeout=60)
        stats = engine.stats()
    assert stats["preemptions"] > 0
    for prompt, out in zip(prompts, outs + [later]):
        want = _host(generate(model, [prompt], max_new_tokens=8, eos_token_id=None))[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == want


def _count_forwards(model, backend):
    """Wrap the model's forward: the list it appends each call's batch shape to."""
    calls = []
    name = "forward" if backend == "torch" else "construct"
    inner = getattr(model, name)

    def counted(input_ids, *args, **kwargs):
        calls.append(tuple(input_ids.shape))
        return inner(input_ids, *args, **kwargs)

    setattr(model, name, counted)
    return calls


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_one_forward_per_step_with_decodes_and_prefill_chunks_together(tmp_path, backend, one_torch_thread):
    """Rows of very different lengths decode while a long prompt is chunked in, with prompt logprobs:
    every engine step is one call of the model, and every request still gets generate()'s tokens."""
    model = load_model(make_checkpoint(tmp_path, "moe", "float32"), backend=backend)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(8, VOCAB, n).tolist() for n in (5, 260, 7, 200)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = Engine(model, block_size=16, max_num_batched_tokens=48).start(background=False)
    # rows of 5 and 260 positions: torch's attention reads the pool in pieces of 64 columns (the short
    # rows sit out the long row's), MindSpore decodes them as two groups of the one forward
    engine._runner.split_padding = 64
    if engine._runner.paged_columns:
        engine._runner.paged_columns = 64
    calls = _count_forwards(model, backend)
    streams = [engine.submit(p, params) for p in prompts[:3]]
    per_step, mixed = [], 0
    while engine.step():
        per_step.append(len(calls))
        calls.clear()
        if len(per_step) == 4:
            # chunked in while the three rows decode, its prompt logprobs from those chunks' own logits
            streams.append(engine.submit(prompts[3], dataclasses.replace(params, prompt_logprobs=2)))
        out = engine._runner
        mixed += bool(out.rows) and bool(out.prefills)
    engine.shutdown()
    assert per_step and set(per_step[:-1]) == {1} and per_step[-1] in (0, 1), per_step  # (last: drops only)
    assert mixed > 0  # steps that decoded rows and computed a chunk
    for prompt, stream in zip(prompts, streams):
        want = _host(generate(model, [prompt], max_new_tokens=12, eos_token_id=None))[0, len(prompt) :].tolist()
        assert stream.result(timeout=10).outputs[0].token_ids == want
    entries = streams[3].result().prompt_logprobs
    scored = _host(score(model, [prompts[3]]))[0]
    assert len(entries) == len(prompts[3]) and entries[0] is None
    assert max(abs(e["logprob"] - float(s)) for e, s in zip(entries[1:], scored[1:])) < 1e-4
