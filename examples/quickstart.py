"""Quickstart: the bundled demo model (a tiny Qwen3.5 that reverses digit strings) on torch.

python examples/quickstart.py [torch|mindspore]
"""

import sys

from transformers import AutoTokenizer

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.demo import demo_model_path

backend = sys.argv[1] if len(sys.argv) > 1 else "torch"
model = load_model(demo_model_path(), backend=backend)
tokenizer = AutoTokenizer.from_pretrained(demo_model_path(), padding_side="left")

prompts = ["rev 12345 =", "rev 908 =", "rev 2026 ="]
batch = tokenizer(prompts, padding=True, return_tensors="np")
defaults = model.generation_defaults  # eos/pad ids from the checkpoint's generation_config.json
config = GenerationConfig(
    max_new_tokens=12, eos_token_id=defaults["eos_token_id"], pad_token_id=defaults["pad_token_id"]
)
out = generate(model, batch["input_ids"], config, attention_mask=batch["attention_mask"])
for row in out.tolist():
    print(tokenizer.decode(row, skip_special_tokens=True))

# sampling: portable seeded noise gives the same tokens on torch and MindSpore
out = generate(
    model, batch["input_ids"], config, attention_mask=batch["attention_mask"], do_sample=True, temperature=0.7, seed=0
)
print("sampled:", [tokenizer.decode(row, skip_special_tokens=True) for row in out.tolist()])
