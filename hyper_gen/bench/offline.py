"""Offline JSONL job: in-flight batching vs fixed micro-batches, on mixed prompt and output lengths.

The job is 256 prompts of the demo task (2..8 digits) whose rows ask for their own number of
new tokens (``"max_tokens"`` per row, drawn independently of the prompt, as real completion
lengths are; EOS off so every row runs to its own limit), in two shapes: uniform in 4..64, and
log-normal in 4..128 (median 32, a long tail: what EOS gives rollouts and chat). The best
in-flight can do is the ratio of the longest row of a micro-batch to the mean row, less the
job's tail (its last rows run in a half-empty batch) and the extra prefill calls. Both runs go through the real job code
(``hyper_gen.jobs.jsonl.run_jsonl``, fsync per result included) with the same batch size:

- fixed: micro-batches sorted by prompt length, each run until its longest row is done (a row
  that is done keeps its slot, padding, until then);
- in-flight: the engine refills a finished row's slot with the next prompt at the next step.

Both produce the same tokens (greedy); the point is seconds. After a warm-up round the two
alternate ``repeats`` times and each keeps its fastest run (a shared machine's load only ever
adds time). Printed with the host (CPU, ISA, threads), since ratios move between hosts.
Run: ``python -m hyper_gen.bench.offline [--backend mindspore] [--rows 256] [--batch-size 16]
[--spread uniform|lognormal|both]``;
``hyper-gen bench serve`` prints it at the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from hyper_gen import registry
from hyper_gen.config import GenerationConfig
from hyper_gen.demo import demo_model_path
from hyper_gen.demo.task import make_prompts
from hyper_gen.host import describe_host
from hyper_gen.jobs import jsonl
from hyper_gen.jobs.logs import quiet_framework_logs
from hyper_gen.jobs.tokenizer import load_tokenizer
from hyper_gen.models.loading import load_model

from .arguments import HelpFormatter, OneLineParser, add_command, positive


@dataclass
class OfflineComparison:
    backend: str
    rows: int
    batch_size: int
    tokens: int
    fixed_s: float
    inflight_s: float
    host: str
    spread: str = "uniform"
    lengths: tuple = (4, 64)

    @property
    def speedup(self) -> float:
        return self.fixed_s / self.inflight_s

    def __str__(self) -> str:
        return "\n".join(
            [
                f"offline JSONL job: {self.rows} rows, {self.lengths[0]}..{self.lengths[1]} new tokens each "
                f"({self.spread}, {self.tokens} in all), batch size {self.batch_size}, {self.backend}",
                f"  {'batching':28s}{'seconds':>10s}{'tokens/s':>12s}",
                f"  {'fixed micro-batches':28s}{self.fixed_s:10.2f}{self.tokens / self.fixed_s:12.1f}",
                f"  {'in-flight (refill)':28s}{self.inflight_s:10.2f}{self.tokens / self.inflight_s:12.1f}",
                f"  in-flight takes {self.speedup:.2f}x fewer seconds",
                self.host,
            ]
        )


SPREADS = ("uniform", "lognormal")
JOBS = (("uniform", (4, 64)), ("lognormal", (4, 128)))  # what the bench prints: both length shapes


def output_lengths(rows: int, spread: str, tokens=(4, 64), seed: int = 0) -> np.ndarray:
    """Per-row completion lengths in ``tokens`` (inclusive): ``uniform``, or ``lognormal`` (median a
    quarter of the longest, a long tail: the shape EOS gives rollouts and chat completions)."""
    rng = np.random.default_rng(seed)
    low, high = tokens
    if spread == "uniform":
        return rng.integers(low, high + 1, size=rows)
    if spread == "lognormal":
        return np.clip(np.round(np.exp(rng.normal(np.log(high / 4), 0.8, size=rows))), low, high).astype(int)
    raise ValueError(f"spread must be one of {SPREADS}, got {spread!r}")


def mixed_job(path: str, rows: int, seed: int = 0, tokens=(4, 64), spread: str = "uniform") -> None:
    """``rows`` demo prompts with per-row max_tokens (see :func:`output_lengths`), independent of the prompt."""
    limits = output_lengths(rows, spread, tokens, seed)
    with open(path, "w", encoding="utf-8") as f:
        for i, ((prompt, _), limit) in enumerate(zip(make_prompts(rows, seed=seed), limits)):
            f.write(json.dumps({"id": i, "prompt": prompt, "max_tokens": int(limit)}) + "\n")


def _threads(backend: str):
    """The threads the backend's CPU kernels ran the job with, where it reports them (torch's intra-op
    threads; MindSpore's CPU kernels report none)."""
    return registry.adapter(backend).intra_op_threads()


def run_offline_comparison(
    model_path=None,
    backend: str = "torch",
    *,
    model=None,
    rows: int = 256,
    batch_size: int = 16,
    seed: int = 0,
    repeats: int = 3,
    spread: str = "uniform",
    lengths=(4, 64),
) -> OfflineComparison:
    """Time both batchings on the mixed job (``model_path`` / ``model``: a checkpoint folder, default
    the demo model); returns the comparison (``str()`` is the printed table)."""
    path = model_path or model or demo_model_path()
    loaded = load_model(path, backend=backend)
    tokenizer = load_tokenizer(path)
    config = GenerationConfig(max_new_tokens=int(lengths[1]), eos_token_id=None, pad_token_id=0)
    context = jsonl.context_length(loaded, tokenizer, path)
    seconds, outputs = {"fixed": [], "inflight": []}, {}
    with tempfile.TemporaryDirectory() as tmp:
        job_file = os.path.join(tmp, "in.jsonl")
        mixed_job(job_file, rows, seed, tokens=lengths, spread=spread)
        for round_ in range(1 + repeats):  # round 0 warms up
            for batching in ("fixed", "inflight"):
                out = os.path.join(tmp, f"{batching}.jsonl")
                if os.path.exists(out):
                    os.remove(out)
                job = jsonl.open_job(job_file, out)
                start = time.perf_counter()
                with contextlib.redirect_stderr(io.StringIO()):  # the job's progress bar and summary line
                    jsonl.run_jsonl(loaded, tokenizer, config, job, batch_size, context=context, batching=batching)
                if round_:
                    seconds[batching].append(time.perf_counter() - start)
                with open(out, encoding="utf-8") as f:
                    outputs[batching] = {r["id"]: r for r in map(json.loads, f)}
    if outputs["fixed"] != outputs["inflight"]:
        raise RuntimeError("in-flight and fixed micro-batches generated different completions")
    tokens = sum(r["completion_tokens"] for r in outputs["inflight"].values())
    return OfflineComparison(
        backend,
        rows,
        batch_size,
        tokens,
        min(seconds["fixed"]),
        min(seconds["inflight"]),
        describe_host(_threads(backend)),
        spread,
        tuple(lengths),
    )


def add_parser(sub) -> None:
    """``hyper-gen bench offline`` (also ``python -m hyper_gen.bench.offline``)."""
    parser = add_command(sub, "offline", "JSONL job: in-flight batching vs fixed micro-batches")
    _add_flags(parser)


def _add_flags(parser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo model)")
    parser.add_argument("--backend", default="torch", choices=["torch", "mindspore"], help="the framework timed")
    parser.add_argument("--rows", type=positive, default=256, help="rows (prompts) in the job")
    parser.add_argument("--batch-size", type=positive, default=16, help="rows decoded together, both batchings")
    parser.add_argument("--repeats", type=positive, default=3, help="timed runs of each batching; the fastest is kept")
    parser.add_argument(
        "--spread",
        choices=SPREADS + ("both",),
        default="both",
        help="output lengths: uniform in 4..64, log-normal in 4..128, or both",
    )


def run_offline(args) -> None:
    for spread, lengths in JOBS:
        if args.spread in (spread, "both"):
            print(
                run_offline_comparison(
                    args.model,
                    args.backend,
                    rows=args.rows,
                    batch_size=args.batch_size,
                    repeats=args.repeats,
                    spread=spread,
                    lengths=lengths,
                )
            )


def main(argv=None) -> None:
    parser = OneLineParser(prog="python -m hyper_gen.bench.offline", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the frameworks' own log messages")
    _add_flags(parser)
    args = parser.parse_args(argv)
    if not args.verbose:
        quiet_framework_logs()
    run_offline(args)


if __name__ == "__main__":
    main()
