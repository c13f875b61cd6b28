"""Shared by the rollout dist scripts: a tiny HF Qwen3.5 built the same on every rank, per-rank
prompts, one-line reports, and the comparisons (never raising: a rank that stopped early would
leave the others waiting in a collective; tests/test_rollout_fsdp.py reads the lines)."""

import atexit
import math
import sys
import time
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import transformers
from qwen_checkpoints import TINY_TEXT_CONFIG

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*fall(ing)? back.*")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

WIDTH = 8  # every rank's prompts are left-padded to this width, so a concatenated batch has the same rows


def setup(timeout_s=120):
    """One torch thread per rank, the gloo group (a bounded collective timeout), this rank and size."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    atexit.register(dist.destroy_process_group)  # a gloo group left open at exit can SIGABRT the rank
    return dist.get_rank(), dist.get_world_size()


def say(rank, check, label, text):
    """One write per line: the ranks share the launcher's stdout."""
    sys.stdout.write(f"rank {rank}: {check} {label} {text}\n")
    sys.stdout.flush()


def build_model(dtype=torch.float32, seed=0, **overrides):
    """A tiny random HF Qwen3_5ForCausalLM (Gated DeltaNet + attention), the same on every rank."""
    config = transformers.Qwen3_5TextConfig(**{**TINY_TEXT_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # O(1) activations and logits, so argmax ties are not an issue
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(noise / math.sqrt(param.shape[-1]) if param.ndim >= 2 else param + 0.1 * noise)
    return model.to(dtype)


def prompts(lengths, vocab, seed):
    """(ids, mask) int64 tensors: one left-padded row per length, ids in [8, vocab) (no pad / EOS ids)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), WIDTH), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, WIDTH - n :] = rng.integers(8, vocab, n)
        mask[row, WIDTH - n :] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def hf_generated(out, width, eos):
    """HF generate's (left-padded) output: each row's generated tokens, up to and with its EOS."""
    rows = []
    for row in out[:, width:].tolist():
        kept = []
        for token in row:
            kept.append(token)
            if token in eos:
                break
        rows.append(kept)
    return rows


def ours_generated(out, mask):
    """hyper_gen's output ([prompt | generated | pad]): each row's generated tokens."""
    if hasattr(out, "sequences"):
        seq, starts, counts = out.sequences.tolist(), out.prompt_lengths.tolist(), out.generated_lengths.tolist()
        return [row[p : p + g] for row, p, g in zip(seq, starts, counts)]
    raise TypeError("pass a GenerateOutput (return_dict_in_generate=True)")


def timed(fn, *args, **kwargs):
    start = time.monotonic()
    value = fn(*args, **kwargs)
    return value, time.monotonic() - start


def verdict(ok):
    return "OK" if ok else "MISMATCH"


def catch(fn):
    """(error type name, first line of its message, seconds) of what fn raised, or (None, None, seconds)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - what every rank raised is the finding
        return type(error).__name__, (str(error).splitlines() or [""])[0], time.monotonic() - start, error
    return None, None, time.monotonic() - start, None


class CharTokenizer:
    """Just what ``stop_strings`` needs of an HF tokenizer, for the random-vocabulary models here:
    token id i reads as the one character chr(0x100 + i)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - 0x100 for c in text]}

    def convert_ids_to_tokens(self, ids):
        return [chr(0x100 + int(i)) for i in ids] if isinstance(ids, list) else chr(0x100 + int(ids))

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)
