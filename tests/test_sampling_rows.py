"""One sampler for generate() and the engine (``sampling.py``): generate's ``TokenSelector`` and the
engine's ``select_rows`` both choose through ``sampling.choose`` (greedy argmax, seeded top-k
candidates drawn on the host), and a row's token does not depend on the rows beside it, so an engine
request draws what generate() draws for its prompt, bit for bit, on torch and MindSpore.
"""

import numpy as np
import pytest
from demo_task import DEMO_MODEL_DIR

from hyper_gen import generate, load_model, sampling
from hyper_gen.engine import Engine, SamplingParams
from hyper_gen.registry import backend_for
from hyper_gen.sampling import RowSettings, SampledRow, select_rows

BACKENDS = ["torch", "mindspore"]
_MODELS = {}


def demo(backend):
    if backend not in _MODELS:
        _MODELS[backend] = load_model(DEMO_MODEL_DIR, backend=backend)
    return _MODELS[backend]


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.numpy()


def ops_of(model):
    return backend_for(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_and_generate_choose_through_one_function(backend, monkeypatch, one_torch_thread):
    """A seeded request with a repetition penalty and a minimum length, n=2 (its choices processed and
    drawn together): each choice is generate()'s row for the same settings, and both went through
    ``sampling.choose``."""
    model = demo(backend)
    callers = []
    choose = sampling.choose

    def counting(*args, **kwargs):
        callers.append(len(args[2]))
        return choose(*args, **kwargs)

    monkeypatch.setattr(sampling, "choose", counting)
    prompt = [3, 17, 25, 9, 40, 41, 12]
    settings = dict(temperature=1.4, top_k=12, top_p=0.9, seed=77, repetition_penalty=1.3)
    ref = host(generate(model, [prompt] * 2, max_new_tokens=8, do_sample=True, min_new_tokens=5, **settings))
    assert callers and set(callers) == {2}  # generate: one choose a step over its batch
    callers.clear()
    engine = Engine(model, max_batch_size=4).start(background=False)
    params = SamplingParams(n=2, max_tokens=8, min_tokens=5, **settings)
    stream = engine.submit(prompt, params)
    greedy = engine.submit(prompt[::-1], SamplingParams(max_tokens=4, temperature=0))
    while engine.step():
        pass
    out = stream.result(timeout=0)
    greedy.result(timeout=0)
    engine.shutdown()
    assert callers  # the engine: through the same function
    eos = model.generation_defaults["eos_token_id"]
    for choice in out.outputs:
        row = ref[choice.index, len(prompt) :].tolist()
        ended = [i for i, t in enumerate(row) if t == eos]
        assert choice.token_ids == (row[: ended[0] + 1] if ended else row)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rows_token_does_not_depend_on_its_neighbours(backend, one_torch_thread):
    """``select_rows`` over a batch of mixed settings gives each row the token it gets alone."""
    ops = ops_of(demo(backend))
    rng = np.random.default_rng(0)
    vocab = 64
    scores = rng.normal(size=(9, vocab)).astype(np.float32) * 3
    seen = [ops.asarray(rng.random((1, vocab)) < 0.2, "bool") for _ in range(9)]
    rows = [
        SampledRow(RowSettings(), 3, 0),
        SampledRow(RowSettings(True, 1.3, 10, 1.0, 0.0, 5), 3, 0),
        SampledRow(RowSettings(True, 1.3, 10, 1.0, 0.0, 5), 4, 1),  # n=2: the same settings, choice 1
        SampledRow(RowSettings(True, 0.7, 0, 0.9, 0.05, 6), 0, 0),
        SampledRow(RowSettings(True, 1.0, 0, 1.0, 0.0, 7), 9, 2),
        SampledRow(RowSettings(), 1, 0, 1.5, seen[5]),
        SampledRow(RowSettings(True, 1.2, 8, 0.95, 0.0, 8), 2, 0, 1.5, seen[6], (4, 9)),
        SampledRow(RowSettings(True, 1.2, 8, 0.95, 0.0, 8), 2, 1, 1.5, seen[7]),
        SampledRow(RowSettings(), 0, 0, 1.0, None, tuple(np.argsort(-scores[8])[:3].tolist())),
    ]
    batch = select_rows(ops, ops.asarray(scores, "float32"), rows, vocab)
    alone = [select_rows(ops, ops.asarray(scores[i : i + 1], "float32"), [row], vocab)[0] for i, row in enumerate(rows)]
    assert batch.tolist() == alone
    assert batch[8] not in np.argsort(-scores[8])[:3]  # the masked ids are never chosen
    skipped = select_rows(ops, ops.asarray(scores, "float32"), rows, vocab, rows=[1, 4, 6])
    assert skipped[[1, 4, 6]].tolist() == batch[[1, 4, 6]].tolist() and not skipped[[0, 2, 3, 5, 7, 8]].any()


def test_a_tied_race_row_takes_the_sorted_path_alone(monkeypatch):
    """A row whose race ties exactly is redrawn on the sorted path; the other rows keep their draw."""
    from hyper_gen import noise

    cfg = RowSettings(True, 1.0, 0, 1.0, 0.0, 3)
    scores = np.log(np.array([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]]))
    tokens = np.broadcast_to(np.arange(3), (2, 3))
    before = noise.sample_candidates(scores, tokens, cfg, 5)
    uniform = noise.uniform_noise

    def tie_row_one(seed, rows, step, tokens):
        u = uniform(seed, rows, step, tokens)
        u[np.asarray(rows) == 1] = [0.5, 0.5, 0.1]  # row 1: tokens 0 and 1 race exactly level
        return u

    monkeypatch.setattr(noise, "uniform_noise", tie_row_one)
    after = noise.sample_candidates(scores, tokens, cfg, 5)
    assert after[0] == before[0]
    assert after[1] == noise._sorted(scores[1:], tokens[1:], cfg, np.array([5]), np.array([1]))[0] == 0
