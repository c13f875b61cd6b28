"""Native MindSpore models. ``qwen3_5.load(checkpoint, dtype)`` builds Qwen3.5 (dense and MoE);
``hyper_gen.loading.load_model(path, backend="mindspore")`` is the public entry point."""
