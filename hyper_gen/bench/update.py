"""``hyper-gen bench update``: ``update_weights`` with every tensor of a checkpoint vs ``load_model`` of it.

What a trainer pays to push new weights into its rollout model, next to what a reload would cost,
in one run per backend: ``load_model`` of a random-weight Qwen3.5 checkpoint (the page cache warm:
a first untimed load reads the files), then ``hyper_gen.update_weights`` with all its tensors, as a
trainer holds them (tensors of the backend's framework). Each is timed ``--repeats`` times in one
process and the fastest kept; the first update of the process (allocator growth) is printed apart.
The issue's bar is an update at most a fifth of the load.
"""

from __future__ import annotations

import gc
import time

from hyper_gen import registry
from hyper_gen.host import describe_host
from hyper_gen.models.loading import load_model
from hyper_gen.models.weight_update import update_weights

from .models import make_checkpoint


def add_parser(sub):
    from .arguments import CACHE_DIR, add_command, backend_list, kernels_spec, positive

    parser = add_command(sub, "update", "update_weights vs load_model of one checkpoint")
    parser.add_argument("--shape", default="0.8b", choices=["mid", "0.8b"], help="checkpoint shape")
    parser.add_argument("--backends", type=backend_list, default="torch,mindspore", help="backends, one at a time")
    parser.add_argument("--repeats", type=positive, default=3, help="timed runs of each; the fastest is kept")
    parser.add_argument(
        "--kernels", type=kernels_spec, default=None, help="auto, plain or a kernel plan .json (default: auto)"
    )

    parser.add_argument("--cache-dir", default=CACHE_DIR, help="where the random-weight checkpoint is written once")
    return parser


def trainer_tensors(path: str, backend: str) -> list:
    """Every tensor of the checkpoint at ``path`` as (HF name, tensor of ``backend``'s framework), as a
    trainer on that framework holds them."""
    import glob
    import os

    from safetensors.numpy import load_file

    tensors = []
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors += sorted(load_file(file).items())
    ops = registry.adapter(backend).host_ops()
    return [(name, ops.asarray(array)) for name, array in tensors]


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_backend(path: str, backend: str, args) -> tuple:
    """(fastest load_model s, first update s, fastest later update s, tensors) for one backend."""
    load = lambda: load_model(path, backend=backend, dtype="float32", kernels=args.kernels)  # noqa: E731
    load()  # warms the page cache (and the kernel plan's cache); the model is dropped at once
    gc.collect()
    loads = []
    for _ in range(args.repeats):
        loads.append(_seconds(load))
        gc.collect()
    model = load()
    tensors = trainer_tensors(path, backend)
    updates = [_seconds(lambda: update_weights(model, tensors)) for _ in range(args.repeats + 1)]
    return min(loads), updates[0], min(updates[1:]), len(tensors)


def run_update(args):
    path = make_checkpoint(args.shape, args.cache_dir)
    rows = []
    for backend in args.backends.split(","):
        rows.append((backend, *time_backend(path, backend, args)))
        gc.collect()
    threads = [registry.adapter(b).intra_op_threads() for b in args.backends.split(",")]
    print(describe_host(next((t for t in threads if t is not None), None)))
    print(f"Qwen3.5 '{args.shape}' random weights, float32, every tensor updated, fastest of {args.repeats}")
    print(f"  {'':12s}{'tensors':>9s}{'load_model s':>14s}{'update s':>10s}{'update/load':>13s}{'first update s':>16s}")
    for backend, load, first, update, count in rows:
        print(f"  {backend:12s}{count:9d}{load:14.2f}{update:10.2f}{update / load:13.2f}{first:16.2f}")
    print("update/load: the issue's bar is 0.20")


__all__ = ["add_parser", "run_update", "trainer_tensors"]
