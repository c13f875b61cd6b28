"""EleutherAI's lm-evaluation-harness against ``hyper-gen serve``, the way people evaluate a served
model: its ``local-completions`` model (token-id prompts, batched, two requests at once) on a
multiple-choice task and a ``loglikelihood_rolling`` (perplexity) task, each of which sends
``echo: true`` with ``logprobs`` and reads the prompt tokens' entries. Its numbers must be those
of its own ``hf`` model on the same checkpoint (the bundled demo model, transformers on torch),
per document and per metric, on torch and MindSpore servers.

The tasks are local (``tests/data/lmeval``: a YAML and a few JSON lines each, no download).
"""

import os

import pytest
import yaml
from demo_task import DEMO_MODEL_DIR
from test_server import Server, serve_cmd

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lmeval")
TASKS = ("reverse_mc", "reverse_text")


def _tasks():
    """The task configs, their data files named by absolute path (lm-eval reads them relative to the cwd)."""
    configs = []
    for name in TASKS:
        with open(os.path.join(DATA, f"{name}.yaml"), encoding="utf-8") as f:
            config = yaml.safe_load(f)
        config["dataset_kwargs"]["data_files"]["test"] = os.path.join(DATA, f"{name}.jsonl")
        configs.append(config)
    return configs


def _evaluate(model: str, model_args: dict):
    """(metrics per task, the per-document responses per task) of one lm-eval run."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_defaults=False)  # lm-eval's thousands of own tasks: a minute to index, unused
    out = simple_evaluate(
        model=model, model_args=model_args, tasks=_tasks(), task_manager=tasks, log_samples=True, bootstrap_iters=0
    )
    metrics = {task: {k: v for k, v in found.items() if "," in k} for task, found in out["results"].items()}
    samples = {}
    for task, docs in out["samples"].items():
        samples[task] = [s["resps"] for s in sorted(docs, key=lambda s: s["doc_id"])]
    return metrics, samples


@pytest.fixture(scope="module")
def hf_reference():
    return _evaluate("hf", {"pretrained": DEMO_MODEL_DIR, "device": "cpu", "dtype": "float32", "batch_size": 4})


def _flat(resps):
    """lm-eval's responses ([[(loglikelihood, is_greedy)], ...] or [[loglikelihood], ...]) as flat lists."""
    values, greedy = [], []
    for doc in resps:
        for resp in doc:
            found = resp[0] if isinstance(resp, list) and len(resp) == 1 else resp
            if isinstance(found, (list, tuple)):
                values.append(float(found[0]))
                greedy.append(bool(found[1]))
            else:
                values.append(float(found))
    return values, greedy


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_lm_eval_local_completions_equal_its_hf_model(backend, hf_reference):
    server = Server(serve_cmd(backend, "--served-model-name", "demo", "-q"))
    try:
        served = _evaluate(
            "local-completions",
            {
                "base_url": server.url + "/v1/completions",
                "model": "demo",
                "tokenizer": DEMO_MODEL_DIR,
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "batch_size": 4,
                "num_concurrent": 2,
                "max_retries": 1,
            },
        )
    finally:
        assert server.stop() == 0, server.log
    want_metrics, want_samples = hf_reference
    got_metrics, got_samples = served
    assert set(got_metrics) == {"hyper_gen_reverse_mc", "hyper_gen_reverse_text"}
    for task, metrics in want_metrics.items():
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert set(got_metrics[task]) == set(metrics), task
        assert {k: got_metrics[task][k] for k in numbers} == pytest.approx(numbers, rel=1e-4), task
        assert {k: v for k, v in got_metrics[task].items() if k not in numbers} == {
            k: v for k, v in metrics.items() if k not in numbers
        }, task
        got, greedy = _flat(got_samples[task])
        want, want_greedy = _flat(want_samples[task])
        assert got == pytest.approx(want, abs=1e-4) and greedy == want_greedy, task
    assert want_metrics["hyper_gen_reverse_mc"]["acc,none"] > 0.5  # the model answers (the task measures something)
