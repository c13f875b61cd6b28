#!/usr/bin/env python
"""Train the tiny demo model bundled with hyper_gen (``hyper_gen/demo/model``), from scratch, on CPU.

The model is a real ``Qwen3_5ForCausalLM`` (transformers' Qwen3.5 text architecture: hybrid Gated
DeltaNet linear-attention + gated full-attention layers), shrunk to ~0.67M parameters, trained on the
synthetic digit-reversal task of ``hyper_gen/demo/task.py`` ("rev 12345 =" -> " 54321" <eos>).
The tokenizer is a character-level HF ``tokenizers`` tokenizer over printable ASCII.

    python examples/train_demo_model.py                      # writes ./demo_model/ (about 20 min on 2 cores)
    python examples/train_demo_model.py --out /tmp/demo --steps 300
    python examples/train_demo_model.py --out hyper_gen/demo/model --force   # replace the bundled model

``--out`` must be a new or empty folder unless ``--force``: the bundled model is what the tests and
the README's outputs are pinned to, so it is never overwritten by accident.

At the end it reloads the saved folder with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and prints
held-out greedy accuracy with HF ``generate()``: one prompt at a time, and in left-padded batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from hyper_gen.demo import task as demo_task  # noqa: E402  (pure python: the task, shared with the tests)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]  # ids 0, 1, 2
# printable ASCII + newline, one token per character
CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]

# user turns are the raw prompt, assistant turns are " " + answer + <eos>; system turns are dropped.
# So a one-message conversation renders exactly as the raw prompt ("rev 123 ="), and a multi-turn
# one as the packed sequences the model was trained on ("rev 12 = 21<eos>rev 345 =").
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ ' ' ~ message['content'] | trim }}{{ eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

MAX_NEW_TOKENS = demo_task.MAX_DIGITS + 4


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast (BPE with no merges = one token per character)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, fuse_unk=True))
    core.add_special_tokens(SPECIAL_TOKENS)
    core.decoder = decoders.Fuse()  # join characters as they are: no spaces inserted
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def check_tokenizer(tokenizer):
    text = "rev 0123 = 3210"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text), (ids, text)
    assert tokenizer.decode(ids) == text, tokenizer.decode(ids)
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 1
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "rev 12 ="}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "rev 12 =", repr(chat)


def finish_tokenizer_files(out: str):
    """Make the saved tokenizer readable by any loader, not only transformers 5: the chat template
    also inside tokenizer_config.json (transformers 5 writes it to chat_template.jinja only), the
    class named PreTrainedTokenizerFast, and a special_tokens_map.json."""
    path = os.path.join(out, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------- model


def build_model(vocab_size: int, pad_id: int, eos_id: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        # gated full attention: GQA 4 query heads over 2 kv heads
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        # Gated DeltaNet: 4 value heads over 2 key heads (as in the real models, v heads > k heads)
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,  # rotary dim 16 of head_dim 32
            "mrope_section": [3, 3, 2],  # sums to rotary_dim / 2 (text-only: all sections see the same position)
            "mrope_interleaved": True,
        },
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    model = Qwen3_5ForCausalLM(config)
    return model


# --------------------------------------------------------------------------- data


def make_batch(rng: random.Random, char_ids, batch_size: int, max_examples: int, eos_id: int, pad_id: int):
    """Rows of 1..max_examples packed examples ("rev 12 = 21<eos>rev 345 = 543<eos>"), right-padded.

    Returns input ids (B, T) and a (B, T) bool mask of the positions whose *next* token is trained on
    (the completion characters and the <eos>; prompts are random digits, not predictable).
    """
    rows, masks = [], []
    for _ in range(batch_size):
        ids, train = [], []
        for _ in range(rng.randint(1, max_examples)):
            prompt, answer = demo_task.sample_training_example(rng)
            p = [char_ids[c] for c in prompt]
            a = [char_ids[c] for c in answer] + [eos_id]
            ids += p + a
            train += [False] * len(p) + [True] * len(a)
        rows.append(ids)
        masks.append(train)
    width = max(len(r) for r in rows)
    input_ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    target_mask = torch.zeros((batch_size, width), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks)):
        input_ids[i, : len(r)] = torch.tensor(r)
        target_mask[i, : len(m)] = torch.tensor(m)
    # position t predicts token t+1: shift the "trained token" mask left by one
    predict_mask = torch.zeros_like(target_mask)
    predict_mask[:, :-1] = target_mask[:, 1:]
    return input_ids, predict_mask


def loss_fn(model, input_ids, predict_mask):
    # right padding only: causal layers never let padding influence the real tokens before it
    logits = model(input_ids=input_ids).logits
    targets = input_ids[:, 1:]
    logits = logits[:, :-1]
    mask = predict_mask[:, :-1]
    loss = F.cross_entropy(logits[mask], targets[mask])
    with torch.no_grad():
        correct = (logits.argmax(-1) == targets) | ~mask
        seq_acc = correct.all(dim=1).float().mean().item()  # every trained token right, whole row
    return loss, seq_acc


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, tokenizer, pairs, batch_size: int):
    """Greedy held-out accuracy: one prompt at a time, and in left-padded batches of ``batch_size``."""
    model.eval()
    prompts = [p for p, _ in pairs]
    single = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        single.append(tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    batched = []
    assert tokenizer.padding_side == "left"
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        enc = tokenizer(chunk, return_tensors="pt", padding=True)
        out = model.generate(
            enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )
        width = enc["input_ids"].shape[1]
        batched += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    acc_single = sum(demo_task.is_correct(p, c) for p, c in zip(prompts, single)) / len(prompts)
    acc_batched = sum(demo_task.is_correct(p, c) for p, c in zip(prompts, batched)) / len(prompts)
    agree = sum(a == b for a, b in zip(single, batched)) / len(prompts)
    exact = sum(c == want for (_, want), c in zip(pairs, single)) / len(prompts)
    return {
        "single": acc_single,
        "batched": acc_batched,
        "single_batched_agree": agree,
        "exact_text_single": exact,
        "examples": list(zip(prompts[:5], single[:5])),
    }


@torch.no_grad()
def evaluate_chat(model, tokenizer, pairs):
    """Two-turn conversations through the chat template: the second answer is checked."""
    model.eval()
    ok = 0
    for (p1, a1), (p2, _) in zip(pairs[0::2], pairs[1::2]):
        messages = [
            {"role": "user", "content": p1},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": p2},
        ]
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        text = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        ok += demo_task.is_correct(p2, text)
    return ok / max(1, len(pairs) // 2)


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    """The command line; ``--out`` checked before any work (exit 2: a folder with files, no --force)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_model", help="a new or empty folder (default: ./demo_model)")
    parser.add_argument("--force", action="store_true", help="write into --out even if it holds files")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--pack", type=int, default=2, help="training rows hold 1..PACK examples")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-n", type=int, default=300, help="held-out prompts for the final accuracy")
    parser.add_argument("--eval-seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.force:
        parser.error(f"--out {args.out} already holds files; pick a new folder, or add --force to replace them")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a file, not a folder")
    return args


def main(argv=None):
    args = parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(f"hyper_gen-demo-train-{args.seed}")

    tokenizer = build_tokenizer()
    check_tokenizer(tokenizer)
    char_ids = {c: tokenizer.convert_tokens_to_ids(c) for c in CHARACTERS}
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id

    model = build_model(len(tokenizer), pad_id, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3_5ForCausalLM, {n_params:,} parameters, layer_types={model.config.layer_types}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    warmup = min(100, args.steps // 10)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    t0 = time.time()
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        input_ids, predict_mask = make_batch(rng, char_ids, args.batch_size, args.pack, eos_id, pad_id)
        loss, seq_acc = loss_fn(model, input_ids, predict_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(
                f"step {step:5d}  loss {loss.item():.4f}  train row acc {seq_acc:.3f}  "
                f"lr {lr_at(step):.2e}  {time.time() - t0:.0f}s",
                flush=True,
            )
    train_s = time.time() - t0
    print(f"training: {args.steps} steps in {train_s:.0f}s")

    # ---- save
    os.makedirs(args.out, exist_ok=True)
    model.eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    finish_tokenizer_files(args.out)
    for name in os.listdir(args.out):
        os.chmod(os.path.join(args.out, name), 0o644)

    # ---- reload exactly what was shipped and evaluate it
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    loaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    loaded_tok = AutoTokenizer.from_pretrained(args.out)
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM", type(loaded)
    assert isinstance(loaded_tok, PreTrainedTokenizerFast), type(loaded_tok)
    check_tokenizer(loaded_tok)
    pairs = demo_task.make_prompts(args.eval_n, seed=args.eval_seed)
    t1 = time.time()
    result = evaluate(loaded, loaded_tok, pairs, batch_size=32)
    chat_acc = evaluate_chat(loaded, loaded_tok, demo_task.make_prompts(100, seed=args.eval_seed + 1))
    print(f"eval took {time.time() - t1:.0f}s; examples: {result['examples']}")
    print(
        f"held-out greedy accuracy ({len(pairs)} prompts, HF generate): "
        f"single {result['single']:.1%}  left-padded batch {result['batched']:.1%}  "
        f"(single/batched identical text {result['single_batched_agree']:.1%}; "
        f"exact completion text {result['exact_text_single']:.1%}); 2-turn chat {chat_acc:.1%}"
    )

    size_kb = os.path.getsize(os.path.join(args.out, "model.safetensors")) / 1024
    with open(os.path.join(args.out, "README.md"), "w", encoding="utf-8") as f:
        f.write(
            "# hyper_gen demo model\n\n"
            f"A tiny ({n_params / 1e6:.2f}M-parameter, fp32, {size_kb:.0f} KB) `Qwen3_5ForCausalLM` (Gated DeltaNet + "
            "gated attention layers) with a character-level tokenizer, trained from scratch by "
            f"`python examples/train_demo_model.py --steps {args.steps} --seed {args.seed}` "
            f"({train_s / 60:.1f} min wall clock on {args.threads} CPU threads; embeddings tied, no lm_head.weight).\n"
            "Task (`hyper_gen/demo/task.py`): reverse 1-8 digits, prompt `rev 12345 =` -> completion "
            "` 54321` + `<eos>`; the chat template renders user turns as the raw prompt.\n"
            f"Held-out greedy accuracy (HF generate, {len(pairs)} prompts never seen in training): "
            f"{result['single']:.1%} one at a time, {result['batched']:.1%} in left-padded batches of 32, "
            f"{chat_acc:.1%} as the 2nd turn of a chat.\n"
        )
    print(f"wrote {args.out}: {sorted(os.listdir(args.out))}")
    return result


if __name__ == "__main__":
    main()
