"""Native MindSpore model kernels, one module per model family (``hyper_gen.models`` describes them)."""
