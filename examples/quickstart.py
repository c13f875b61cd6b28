"""Quickstart: greedy and sampled generation on the bundled demo model (torch)."""

from hyper_gen import GenerationConfig, generate
from hyper_gen.demo import demo_model_and_tokenizer

model, tokenizer = demo_model_and_tokenizer(backend="torch")
prompts = ["rev 12345 =", "rev 908 ="]
batch = tokenizer(prompts, padding=True, return_tensors="np")
out = generate(model, batch["input_ids"], GenerationConfig(max_new_tokens=16, eos_token_id=tokenizer.eos_token_id,
                                                            pad_token_id=tokenizer.pad_token_id),
               attention_mask=batch["attention_mask"])
for prompt, row in zip(prompts, out.tolist()):
    print(repr(prompt), "->", repr(tokenizer.decode(row, skip_special_tokens=True)))
