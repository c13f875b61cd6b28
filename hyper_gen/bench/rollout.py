"""``hyper-gen bench rollout``: a 2-rank FSDP2 rollout, hyper_gen next to its anchors, in one run.

    torchrun --nproc_per_node 2 -m hyper_gen bench rollout [--hidden 256 --layers 4 --prompts 4 --samples 4 ...]

An HF Qwen3.5 (random weights, fixed seed) sharded with ``fully_shard`` on every decoder layer and
the root; each rank its own prompts x ``--samples`` samples. Rows end at a realistic spread of lengths:
each row's length is drawn (per rank, log-normal around a quarter of ``--new-tokens``, a long tail
cut at the cap) and a logits processor makes that row emit EOS at that step, for every method
alike, so every method makes the same useful tokens. Methods:

- ``hyper_gen synced``: step-synced generate with the KV cache (finished ranks feed dummy steps);
- ``hyper_gen synced + unshard_params``: the same with the parameters gathered once per call;
- ``fixed-iteration, no cache``: the workaround trainers use (``eos_token_id=None, use_cache=False``):
  every row runs to the cap and every step recomputes the whole sequence;
- ``HF generate synced_gpus=True``: HF's own step sync on the same sharded model.

Printed per method: wall seconds (the slowest rank), forwards per rank, useful tokens (up to each
row's EOS, both ranks), useful tokens/s, and the share of each rank's time spent inside
``torch.distributed`` collectives (FSDP's parameter all-gathers, hyper_gen's and HF's step-sync
all-reduces; asynchronous ones are waited inside the timer), which includes waiting for the
other rank, and all-gathers per rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import numpy as np

from hyper_gen.jobs.errors import UsageError

_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
)


class CollectiveTimer:
    """Seconds and calls spent in ``torch.distributed``'s collectives while active (a monkeypatch of
    the module's functions, which FSDP, hyper_gen and HF all call through ``torch.distributed.X``)."""

    def __init__(self):
        self.seconds = 0.0
        self.calls: dict = {}

    def reset(self):
        self.seconds, self.calls = 0.0, {}

    @contextlib.contextmanager
    def active(self):
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

        def wrap(name, fn):
            def timed(*args, **kwargs):
                start = time.perf_counter()
                work = fn(*args, **kwargs)
                if kwargs.get("async_op") and work is not None:
                    work.wait()  # count the whole transfer here (waiting again later is a no-op)
                self.seconds += time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
                return work

            return timed

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def _build(args):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    heads = max(2, args.hidden // 64)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)],
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        linear_num_key_heads=max(1, heads // 2),
        linear_num_value_heads=heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).eval()


def _scheduled_eos(torch, transformers):
    class ScheduledEOS(transformers.LogitsProcessor):
        """Row r emits ``eos`` at step ``lengths[r] - 1`` and never before (nor after, where the
        workaround keeps generating), whatever the sampler would pick: a fixed, known EOS spread."""

        def __init__(self, lengths, width, eos):
            self.lengths, self.width, self.eos = torch.as_tensor(lengths), width, eos

        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - self.width
            scores = scores.clone()
            scores[:, self.eos] = -float("inf")
            end = self.lengths - 1 == step
            if bool(end.any()):
                scores[end] = -float("inf")
                scores[end, self.eos] = 0.0
            return scores

    return ScheduledEOS


def _useful(tokens: np.ndarray, eos: int) -> np.ndarray:
    """(B,) generated tokens up to and with each row's first EOS (all of them without one)."""
    hit = tokens == eos
    return np.where(hit.any(1), hit.argmax(1) + 1, tokens.shape[1])


def run_rollout(args):
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import fully_shard

    from hyper_gen import generate
    from hyper_gen.host import describe_host
    from hyper_gen.parallel.launcher import init_distributed, shutdown_distributed

    if not init_distributed("torch", timeout_s=args.timeout):
        raise UsageError(
            "rollout runs on 2 ranks: launch it with torchrun --nproc_per_node 2 -m hyper_gen bench rollout"
        )
    torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build(args)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    forwards = {"n": 0}
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__("n", forwards["n"] + 1))

    eos, n, cap, width = 1, args.samples, args.new_tokens, args.prompt_len
    rng = np.random.default_rng(100 + rank)
    ids = torch.from_numpy(rng.integers(2, args.vocab, (args.prompts, width)))
    mask = torch.ones_like(ids)
    rows = args.prompts * n
    lengths = np.clip(np.round(rng.lognormal(np.log(cap / 4), 0.8, rows)), 1, cap).astype(np.int64)
    processor = _scheduled_eos(torch, transformers)(lengths, width, eos)
    sampling = dict(do_sample=True, top_k=50, temperature=1.0, num_return_sequences=n, pad_token_id=0)

    def ours(max_new, **extra):
        out = generate(
            model,
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            seed=0,
            return_dict_in_generate=True,
            logits_processor=[processor],
            **sampling,
            **{"eos_token_id": eos, **extra},
        )
        seq = out.sequences.numpy()
        return np.stack([np.pad(seq[r, width:], (0, max(0, width + max_new - seq.shape[1]))) for r in range(rows)])

    def hf(max_new):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            eos_token_id=eos,
            synced_gpus=True,
            logits_processor=transformers.LogitsProcessorList([processor]),
            **sampling,
        )
        return out[:, width:].numpy()

    methods = [
        ("hyper_gen synced, cache", lambda m: ours(m)),
        ("hyper_gen synced, cache, unshard_params", lambda m: ours(m, unshard_params=True)),
        ("fixed-iteration, no cache (eos=None)", lambda m: ours(m, eos_token_id=None, use_cache=False)),
        ("HF generate synced_gpus=True", hf),
    ]
    timer = CollectiveTimer()
    results = []
    with torch.no_grad():
        for label, run in methods:
            run(2)  # warm-up: FSDP's lazy init, first-call allocations
            best = None
            for _ in range(args.repeats):
                dist.barrier()
                forwards["n"] = 0
                timer.reset()
                with timer.active():
                    start = time.perf_counter()
                    tokens = run(cap)
                    local = time.perf_counter() - start
                wall = torch.tensor([local])
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                trial = (float(wall), local, timer.seconds, dict(timer.calls), forwards["n"], tokens)
                best = trial if best is None or trial[0] < best[0] else best
            wall, local, in_collectives, calls, steps, tokens = best
            useful = _useful(tokens, eos)
            exact = int((useful == lengths).all())
            stats = torch.tensor(
                [float(useful.sum()), in_collectives / local, calls.get("all_gather_single", 0), steps, exact],
                dtype=torch.float64,
            )
            everyone = [torch.zeros_like(stats) for _ in range(world)]
            dist.all_gather(everyone, stats)
            results.append((label, wall, torch.stack(everyone).numpy()))

    if rank == 0:
        print(
            f"bench rollout: HF Qwen3_5ForCausalLM hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
            f"float32, FSDP2 (fully_shard per layer + root) over {world} ranks (gloo); per rank {args.prompts} prompts "
            f"x {n} samples, prompt {width} tokens, max {cap} new tokens, sampling top_k=50"
        )
    spread = torch.tensor([lengths.min(), np.median(lengths), lengths.max(), lengths.sum()], dtype=torch.float64)
    spreads = [torch.zeros_like(spread) for _ in range(world)]
    dist.all_gather(spreads, spread)
    if rank == 0:
        for r, s in enumerate(spreads):
            print(f"  rank {r} EOS spread: row lengths min {s[0]:.0f} / median {s[1]:.0f} / max {s[2]:.0f} new tokens")
        print(describe_host(torch.get_num_threads()) + " per rank")
        head = f"{'method':42} {'wall s':>7} {'fwd/rank':>8} {'useful tok':>10} {'tok/s':>7} {'in collectives':>15}"
        print(head + f" {'all-gathers/rank':>17}")
        for label, wall, table in results:
            useful = table[:, 0].sum()
            shares = "/".join(f"{100 * s:.0f}%" for s in table[:, 1])
            ok = "" if table[:, 4].all() else "  (EOS schedule not followed!)"
            print(
                f"{label:42} {wall:7.2f} {'/'.join(str(int(x)) for x in table[:, 3]):>8} {useful:10.0f} "
                f"{useful / wall:7.1f} {shares:>15} {'/'.join(str(int(x)) for x in table[:, 2]):>17}{ok}"
            )
        print("in collectives: each rank's share of its wall time inside torch.distributed calls (rank 0/rank 1)")
    dist.barrier()
    model = None  # FSDP's state holds the mesh's group: dropped before the groups are destroyed
    shutdown_distributed("torch")
    # Leave without the interpreter's teardown: gloo worker threads still holding FSDP's async work
    # can abort a rank at finalization ("terminate called without an active exception", SIGABRT;
    # pytorch/pytorch#179291) after all its work is done (seen under load in CI); nothing is left to flush
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
