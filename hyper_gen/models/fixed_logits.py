"""A cache-object model whose forward only returns fixed logits, for any framework: everything
``generate`` spends around it is the loop's own cost (``bench loop``). Written once here; each
adapter's ``fixed_logits_model`` gives it the framework's module class and a frozen parameter."""

from __future__ import annotations

import time


def fixed_logits_model(module_class, logits):
    """A ``module_class`` (torch ``nn.Module``, MindSpore ``nn.Cell``) holding ``logits``, a
    frozen (batch, 1, vocab) parameter of its framework, and returning it from every forward (one
    method, named ``forward`` for torch and ``construct`` for MindSpore); ``forward_seconds`` adds
    up the forwards' time."""

    class FixedLogits(module_class):
        supports_cache_object = True

        def __init__(self):
            super().__init__()
            self.logits = logits
            self.forward_seconds = 0.0

        def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, logits_to_keep=0):
            start = time.perf_counter()
            out = {"logits": self.logits}
            self.forward_seconds += time.perf_counter() - start
            return out

        construct = forward

    return FixedLogits()
