"""Held-out prompts and the answer check for the bundled demo model (``hyper_gen/demo/model``).

The task itself lives in ``hyper_gen/demo/task.py`` (pure python, shared with
``examples/train_demo_model.py``); this module only re-exports what a test needs::

    from demo_task import make_prompts, is_correct
    for prompt, expected in make_prompts(50, seed=0):   # never seen in training
        assert is_correct(prompt, generated_text)
"""

import os

from hyper_gen.demo.task import MAX_DIGITS, answer_for, is_correct, make_prompts, parse_prompt, prompt_for

# the checkout's copy (tests run from the repository); an installed package has it under hyper_gen/
DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hyper_gen", "demo", "model")

__all__ = ["make_prompts", "is_correct", "parse_prompt", "prompt_for", "answer_for", "MAX_DIGITS", "DEMO_MODEL_DIR"]
