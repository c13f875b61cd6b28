"""``hyper-gen bench text``: the engine's output processing per generated token (the choice's
incremental text and its stop strings), at a short and a long output.

The engine turns each choice's ids into text as they arrive (``hyper_gen.engine.detokenize``); if
that cost grew with the output, a 16k-token rollout would spend its time re-decoding its own prefix.
Per length: a seeded random id stream of the tokenizer's vocabulary, fed one id at a time to one
growing list as the engine does, with a stop string that does not occur (so the held-back window
and the stop search are timed too), then ``finish()`` and the final text. Printed: microseconds per
token at each length (the process's CPU time, so that other processes on a shared host weigh
less; best of ``--repeats``, the lengths interleaved so that a busy spell hits them alike) and the
long / short ratio, which stays near 1 when the cost per token does not depend on the output's
length. Single-threaded Python plus the tokenizer's Rust decode; the host is printed.
"""

from __future__ import annotations

import time

import numpy as np

from hyper_gen.engine.detokenize import IncrementalText
from hyper_gen.host import describe_host

STOPS = ("</answer>",)


def add_parser(sub):
    from .arguments import add_command, positive, positive_list

    parser = add_command(sub, "text", "detokenization and stop strings: time per token vs length")
    parser.add_argument(
        "--tokenizer", default=None, help="a model folder with a tokenizer (default: the bundled demo model's)"
    )
    parser.add_argument("--lengths", type=positive_list, default="256,16384", help="generated tokens, comma-separated")
    parser.add_argument("--repeats", type=positive, default=5, help="timed runs per length; the fastest is kept")
    return parser


def _time_one(tokenizer, ids, stops) -> float:
    text = IncrementalText(tokenizer, list(stops))
    so_far = []
    start = time.process_time()
    for token in ids:
        so_far.append(token)
        text.update(so_far)
    text.finish()
    _ = text.text  # the final text, joined once
    return time.process_time() - start


def text_processing(tokenizer, lengths=(256, 16384), stops=STOPS, repeats: int = 5) -> list:
    """[(length, seconds per token)] of one choice's text over a random stream of ``length`` ids; prints a table."""
    streams = {n: np.random.default_rng(0).integers(0, len(tokenizer), size=n).tolist() for n in lengths}
    best = dict.fromkeys(lengths, float("inf"))
    for _ in range(repeats):
        for n in lengths:
            best[n] = min(best[n], _time_one(tokenizer, streams[n], stops))
    rows = [(n, best[n] / n) for n in lengths]
    print(describe_host(1))
    name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    print(f"output processing per token: tokenizer {name} ({len(tokenizer)} ids), stop strings {list(stops)}")
    print(f"  {'tokens':>8s}{'us/token (CPU)':>16s}")
    for length, seconds in rows:
        print(f"  {length:8d}{seconds * 1e6:16.2f}")
    if len(rows) > 1:
        print(f"longest / shortest: {rows[-1][1] / rows[0][1]:.2f}x per token")
    return rows


def run_text(args):
    from hyper_gen.demo import demo_model_path
    from hyper_gen.jobs.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or demo_model_path())  # a bad folder: UsageError, one line, exit 2
    text_processing(tokenizer, args.lengths, repeats=args.repeats)


__all__ = ["add_parser", "run_text", "text_processing"]
