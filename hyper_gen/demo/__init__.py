"""The bundled demo: a tiny Qwen3.5 trained to reverse digit strings (``model/``) and its task
(``task``), so every command runs on a fresh machine without downloading weights."""

from importlib import resources


def demo_model_path() -> str:
    """The folder of the bundled demo checkpoint (config, safetensors, tokenizer)."""
    return str(resources.files("hyper_gen.demo") / "model")


__all__ = ["demo_model_path"]
