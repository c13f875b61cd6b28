"""``GenerateMixin``: ``model.generate(...)`` for any torch Module or MindSpore Cell."""

from __future__ import annotations


class GenerateMixin:
    """Mix in before the framework base: ``class M(GenerateMixin, torch.nn.Module)``."""

    def generate(self, input_ids, generation_config=None, attention_mask=None, **config_overrides):
        from .generation import generate

        return generate(self, input_ids, generation_config, attention_mask, **config_overrides)
