"""Two msrun ranks: the native MindSpore demo model wrapped by HyperParallel's own ``hsdp`` (a real
``HSDP<Class>`` cell with its scheduler). Its sharded forward cannot run on CPU (no
``InnerCommAllGather`` kernel), so every parameter is kept whole (``threshold`` above their sizes):
the forward HyperParallel can run here. Each rank has its own prompt, rank 0's ending at its EOS
long before rank 1's 12 tokens. Checks, printed as ``rank R: <check> <label> <text>`` lines:

- the adapter recognises the cell (``collective_forward``): generate step-syncs by default;
- greedy tokens equal the unwrapped model's on this rank's prompt, for ``synced_gpus`` None and
  True and with ``unshard_params=True``; both ranks run the same number of forwards (step sync),
  where ``synced_gpus=False`` lets rank 0 stop after its own;
- a bad token id on rank 1 only: both ranks raise, rank 0 naming rank 1.
"""

import numpy as np
from hyper_parallel import hsdp
from transformers import AutoTokenizer

import hyper_gen
from hyper_gen import registry
from hyper_gen.demo import demo_model_path
from hyper_gen.parallel.launcher import host_ops, init_distributed

assert init_distributed("mindspore")
ops = host_ops("mindspore")
rank = ops.rank()


def say(check, label, text):
    print(f"rank {rank}: {check} {label} {text}", flush=True)


reference = hyper_gen.load_model(demo_model_path(), backend="mindspore")
model = hsdp(hyper_gen.load_model(demo_model_path(), backend="mindspore"), shard_size=2, threshold=10**9)
say(
    "setup",
    "type",
    f"{type(model).__name__} collective_forward={registry.adapter('mindspore').collective_forward(model)}",
)
tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
prompt = np.array([tokenizer("rev 7 =" if rank == 0 else "rev 1234567 =")["input_ids"]], dtype=np.int64)
forwards = {"n": 0}
original = type(model).construct


def counted(self, *args, **kwargs):
    forwards["n"] += 1
    return original(self, *args, **kwargs)


common = dict(max_new_tokens=12, eos_token_id=[1], return_dict_in_generate=True)
expected = hyper_gen.generate(reference, prompt, **common)
expected = expected.sequences.asnumpy().tolist()
type(model).construct = counted
calls = (("auto", {}), ("synced", {"synced_gpus": True}), ("unshard", {"unshard_params": True}))
for label, extra in calls + (("unsynced", {"synced_gpus": False}),):  # the forwards a rank runs alone
    forwards["n"] = 0
    out = hyper_gen.generate(model, prompt, **common, **extra)
    ok = out.sequences.asnumpy().tolist() == expected
    say(
        "greedy", label, f"{'OK' if ok else 'MISMATCH'} forwards={forwards['n']} tokens={int(out.generated_lengths[0])}"
    )
bad = prompt.copy()
if rank == 1:
    bad[0, -1] = 10**6
try:
    hyper_gen.generate(model, bad, **common)
    say("error", "oov", "type=None")
except Exception as error:  # noqa: BLE001 - what every rank raised is the finding
    say("error", "oov", f"type={type(error).__name__} message={str(error).splitlines()[0]}")
say("done", "all", "ok")
