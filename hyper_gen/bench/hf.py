"""``hyper-gen bench hf``: HF ``generate`` vs ``hyper_gen.generate`` on the same HF Qwen3.5 model."""

from __future__ import annotations

import time

from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.host import describe_host


# ---- HF generate vs hyper_gen on the same HF model -----------------------------------------
def _hf_qwen35(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    heads = max(hidden // 64, 2)
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    return Qwen3_5ForCausalLM(cfg).eval()


def _time(fn, repeats: int):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_hf(args):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads) if args.threads else None
    model = _hf_qwen35(args.hidden, args.layers, args.vocab)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt_len))
    new = args.new_tokens

    def hf(n):
        return lambda: model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
        )

    def ours(n):
        return lambda: generate(model, ids, GenerationConfig(max_new_tokens=n, eos_token_id=None))

    rows = []
    for name, make in (("HF generate", hf), ("hyper_gen.generate", ours)):
        prefill = _time(make(1), args.repeats)
        total = _time(make(new), args.repeats)
        rows.append((name, prefill, (new - 1) * args.batch / (total - prefill)))
    print(describe_host(torch.get_num_threads()))
    print(
        f"HF Qwen3.5 hidden={args.hidden} layers={args.layers} vocab={args.vocab} B={args.batch} "
        f"prompt={args.prompt_len} new={new} threads={torch.get_num_threads()}"
    )
    for name, prefill, tps in rows:
        print(f"  {name:20s} prefill {prefill * 1e3:8.1f} ms   decode {tps:8.1f} tok/s")
    print(f"  hyper_gen / HF decode speed: {rows[1][2] / rows[0][2]:.3f}x")
