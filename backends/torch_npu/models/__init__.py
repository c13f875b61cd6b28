"""Native torch models, found by the checkpoint's HF architecture name.

``load(checkpoint, dtype, device)`` returns a ``torch.nn.Module`` implementing the cache-object
contract (docs/model_contract.md). Model modules are imported on first use.
"""

import importlib

# HF architecture name -> module under this package that implements it
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
}


def load(checkpoint, dtype: str = "float32", device=None):
    """The native model for ``checkpoint`` (a ``hyper_gen.checkpoint.Checkpoint``) in ``dtype``."""
    if checkpoint.architecture not in ARCHITECTURES:
        raise ValueError(
            f"no native torch model for architecture {checkpoint.architecture!r}; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    module = importlib.import_module(f"{__name__}.{ARCHITECTURES[checkpoint.architecture]}")
    return module.load(checkpoint, dtype, device=device)
