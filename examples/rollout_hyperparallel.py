"""GRPO/PPO-style rollouts from an HF model sharded by HyperParallel's own torch ``fully_shard``,
inside the training job: examples/rollout_fsdp.py with ``--sharder hyperparallel``.

    pip install --no-deps ../shared/vendor/hyper-parallel-fdd0a80.tar.gz   # HyperParallel is not on PyPI
    torchrun --nproc_per_node 2 examples/rollout_hyperparallel.py [MODEL_DIR] [--samples 4] [--seed 0]

Its modules (``HSDP<Class>``) and ``hyper_parallel`` DTensor parameters are recognised like torch's
FSDP2: ranks step together (``synced_gpus=None``), and ``unshard_params=True`` gathers once per call
through their ``unshard()`` / ``reshard()``.
"""

import os
import runpy
import sys

os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "torch")  # HyperParallel picks MindSpore whenever MindSpore imports
sys.argv[1:1] = ["--sharder", "hyperparallel"]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "rollout_fsdp.py"), run_name="__main__")
