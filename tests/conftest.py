import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# kernel plans timed by the suite (kernels="auto") live in one folder per run, shared with the
# torchrun / msrun / CLI subprocesses the tests start, never in the user's cache
if "HYPER_GEN_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["HYPER_GEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="hyper_gen-test-cache-")

# under pytest-xdist (-n 2: one worker a core) each worker computes on one thread: two workers
# of two OpenMP threads each on 2 cores spend their time waiting for one another
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from backend_harness import HARNESSES

# the conformance suite runs on every backend listed here
BACKENDS = ["torch", "mindspore"]


def pytest_configure(config):
    """The engine's paged-attention kernel is built on first use (torch's extension loader, ~30 s on
    2 cores): built once here, in the run's first process, before any worker, server or torchrun
    subprocess a test starts needs it (their start-up timeouts would otherwise pay for the build)."""
    if not hasattr(config, "workerinput"):
        from hyper_gen.backends.torch import paged_kernel

        paged_kernel.available()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown (and unused) under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """Each test file on one worker under -n 2 (``--dist loadfile``): a module-scoped torchrun / msrun
    job then runs once; with xdist's default ``load`` every worker that got one of its tests ran it."""
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return HARNESSES[request.param]()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls on a shared 2-core machine: a second OpenMP thread costs 30x in waits."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cli(capfd, monkeypatch):
    """``cli(args, stdin=None, env=None)``: the ``hyper-gen`` CLI run in this process (tests/cli_runner.py)."""
    from cli_runner import InProcessCLI

    return InProcessCLI(capfd, monkeypatch)


# The slowest single-process cases (6 s and more each, `--durations` of `-n 2` on 2 cores) are `slow`: the fast
# loop (-m "not distributed and not slow") leaves them out, the whole suite runs them. Each names
# its test and the parameter id that makes it slow.
SLOW_CASES = {
    ("test_prefix_hits_give_generates_tokens", "mindspore-moe"),
    ("test_one_long_row_among_short_ones_decodes_apart_with_the_same_tokens", "mindspore"),
    ("test_run_batch_returns_input_order_and_many_more_than_the_batch", "mindspore"),
    ("test_abort_one_leaves_the_others_unchanged", "mindspore"),
    ("test_a_request_never_waits_for_the_batch", "mindspore-compiled"),
    ("test_greedy_equals_generate_with_staggered_arrivals", "mindspore-compiled"),
    ("test_mindspore_is_quiet_by_default_and_verbose_on_request", ""),  # two CLI subprocesses
    ("test_a_dynamic_caches_batch_size_runs_compiled_once_seen_enough", ""),
    ("test_demo_model_solves_heldout_prompts", "1-mindspore"),
    ("test_sigint_and_sigterm_stop_cleanly", ""),  # a server subprocess, signalled twice
    ("test_ctrl_c_exits_130_with_one_line_and_the_rerun_resumes", "mindspore"),
    ("test_inflight_rows_equal_fixed_micro_batches_and_seeds_follow_the_row", "mindspore"),
    ("test_padded_projection_widths_change_no_result", "moe-float32"),
    ("test_generate_from_four_threads", "mindspore"),
    ("test_jsonl_killed_halfway_then_resumed", ""),
    ("test_abort_all_returns_the_partial_rollouts", "mindspore"),
    ("test_compiled_decode_equals_pynative", "static"),
    ("test_compiled_decode_equals_pynative", "dynamic"),
    ("test_compiled_blocks_give_a_row_the_same_result_in_any_batch", ""),
    ("test_greedy_tokens_equal_hf_generate", "mindspore-moe"),
    ("test_greedy_equals_generate_with_staggered_arrivals", "mindspore"),
}


# The heaviest files (whole-suite `--durations=0` of `-n 2`, seconds a file, heaviest first) start
# first, so neither worker is left with a long file at the end while the other idles.
HEAVY_FILES = (
    "test_cp_tp_mindspore.py",
    "test_weight_update.py",
    "test_cp_mindspore.py",
    "test_memory_soak.py",
    "test_ranks_threads_memory.py",
    "test_cp_torch.py",
    "test_readme.py",
    "test_tp_mindspore.py",
    "test_model_conformance.py",
    "test_kernel_plan.py",
    "test_rollout_fsdp.py",
    "test_rollout_mindspore.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FILES)))  # stable: files keep their order
    for item in items:
        name, _, rest = item.name.partition("[")
        if (name, rest.rstrip("]")) in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
