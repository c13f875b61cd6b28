"""EngineConfig (hyper_gen/engine/config.py): the engine's settings in one value with vLLM's names. A bad
value is refused when made, naming the field and the value; ``Engine(model, config=...)`` builds the same
cache as the keywords it replaces, which keep working (old names included); ``hyper-gen serve`` builds one
from its flags (vLLM's flag names are aliases of its own).

Models are the one-layer stubs of the backend harness (tests/stub_torch.py, tests/stub_mindspore.py): an
engine over one probes one forward and allocates a pool of a few KiB.
"""

import dataclasses
import warnings

import numpy as np
import pytest

from hyper_gen.engine import Engine, EngineConfig
from hyper_gen.kv_cache.manager import DEFAULT_STATE_SNAPSHOT_BLOCKS

FIELDS = (
    "max_num_seqs",
    "max_model_len",
    "block_size",
    "enable_prefix_caching",
    "max_num_batched_tokens",
    "kv_cache_memory_bytes",
    "state_snapshot_blocks",
    "admit_batch",
)
# what the pool's size and layout come from, in engine.stats()
POOL = ("cache_memory_bytes", "block_size", "blocks_total", "bytes_per_block")


@pytest.fixture
def model(backend):
    return backend.stub()


def settings(engine):
    """What an engine runs with, as read by the code that uses it."""
    scheduler = engine._scheduler
    return {
        "pool": {k: engine.stats()[k] for k in POOL},
        "max_batch_size": engine.max_batch_size,
        "max_model_len": engine.max_model_len,
        "admit_batch": engine.admit_batch,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_num_seqs": scheduler.max_num_seqs,
        "enable_prefix_caching": scheduler.kv.enable_prefix_caching,
        "state_snapshot_blocks": scheduler.kv.snapshots.every_blocks,
    }


def test_defaults_are_the_engines_under_vllms_names():
    config = EngineConfig()
    assert tuple(f.name for f in dataclasses.fields(EngineConfig)) == FIELDS
    assert dataclasses.asdict(config) == {
        "max_num_seqs": 32,
        "max_model_len": None,
        "block_size": 16,
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory_bytes": None,
        "state_snapshot_blocks": DEFAULT_STATE_SNAPSHOT_BLOCKS,
        "admit_batch": 1,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32
    changed = config.replace(block_size=32, kv_cache_memory_bytes=np.int64(1 << 20))
    assert (changed.block_size, changed.kv_cache_memory_bytes, config.block_size) == (32, 1 << 20, 16)
    assert type(changed.kv_cache_memory_bytes) is int  # numpy ints are taken as ints
    assert dataclasses.replace(config, admit_batch=4) == EngineConfig(admit_batch=4)


@pytest.mark.parametrize(
    "field, value, error, message",
    [
        ("max_num_seqs", 0, ValueError, "max_num_seqs must be a positive int, got 0"),
        ("max_model_len", -3, ValueError, "max_model_len must be a positive int, got -3"),
        ("block_size", 1.5, ValueError, "block_size must be a positive int, got 1.5"),
        ("block_size", None, ValueError, "block_size must be a positive int, got None"),
        ("enable_prefix_caching", 1, TypeError, "enable_prefix_caching must be a bool, got 1"),
        ("max_num_batched_tokens", True, ValueError, "max_num_batched_tokens must be a positive int, got True"),
        ("kv_cache_memory_bytes", 0, ValueError, "kv_cache_memory_bytes must be a positive int, got 0"),
        ("state_snapshot_blocks", "4", ValueError, "state_snapshot_blocks must be a positive int, got '4'"),
        ("admit_batch", 0, ValueError, "admit_batch must be a positive int, got 0"),
    ],
)
def test_a_bad_value_names_its_field_and_value(field, value, error, message):
    for make in (lambda: EngineConfig(**{field: value}), lambda: EngineConfig().replace(**{field: value})):
        with pytest.raises(error) as raised:
            make()
        assert str(raised.value) == message


@pytest.mark.parametrize(
    "keywords, error, message",
    [  # the engine's own names keep the messages they always gave
        ({"max_batch_size": 0}, ValueError, "max_batch_size must be a positive int, got 0"),
        ({"cache_memory_bytes": -1}, ValueError, "cache_memory_bytes must be a positive int, got -1"),
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be a positive int, got 0"),
        ({"block_size": 0}, ValueError, "block_size must be a positive int, got 0"),
        ({"enable_prefix_caching": "yes"}, TypeError, "enable_prefix_caching must be a bool, got 'yes'"),
        ({"max_batch_size": 4, "max_num_seqs": 4}, TypeError, "got both max_batch_size= and max_num_seqs="),
        (
            {"cache_memory_bytes": 1 << 20, "kv_cache_memory_bytes": 1 << 20},
            TypeError,
            "got both cache_memory_bytes= and kv_cache_memory_bytes=",
        ),
        (
            {"max_prefill_tokens": 64, "max_num_batched_tokens": 64},
            TypeError,
            "got both max_prefill_tokens= and max_num_batched_tokens=",
        ),
        ({"max_batch": 4}, TypeError, "Engine() got an unexpected keyword argument 'max_batch'"),
        ({"config": {"block_size": 4}}, TypeError, "config must be an EngineConfig, got {'block_size': 4}"),
    ],
)
def test_engine_keywords_refused(model, keywords, error, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(error) as raised:
            Engine(model, **keywords)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_config_builds_the_engine_its_keywords_build(model):
    # no kv_cache_memory_bytes: the default pool is max_num_seqs rows of max_model_len positions, so
    # both must reach the pool's sizing
    config = EngineConfig(
        max_num_seqs=3,
        max_model_len=40,
        block_size=4,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
        state_snapshot_blocks=2,
        admit_batch=2,
    )
    by_config = Engine(model, config=config)
    assert by_config.config is config
    old_names = Engine(
        model,
        max_batch_size=3,
        max_model_len=40,
        block_size=4,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
        state_snapshot_blocks=2,
        admit_batch=2,
    )
    new_names = Engine(model, **dataclasses.asdict(config))
    expected = settings(by_config)
    assert expected["pool"]["cache_memory_bytes"] == 3 * (40 // 4) * expected["pool"]["bytes_per_block"]
    assert expected["pool"]["blocks_total"] == 3 * (40 // 4)
    assert expected["pool"]["block_size"] == 4
    assert expected == {
        **expected,
        "max_batch_size": 3,
        "max_model_len": 40,
        "admit_batch": 2,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": False,
        "state_snapshot_blocks": 2,
    }
    for engine in (old_names, new_names):
        assert settings(engine) == expected
        assert engine.config == config


def test_keywords_override_the_config_and_the_pool_is_the_budget(model):
    config = EngineConfig(block_size=4, max_model_len=40, kv_cache_memory_bytes=8192)
    engine = Engine(model, config=config, max_batch_size=5, admit_batch=9)
    assert engine.config == config.replace(max_num_seqs=5, admit_batch=9)
    assert config.max_num_seqs == 32  # the caller's config is left as it was
    assert (engine.max_batch_size, engine.admit_batch) == (5, 5)  # admit_batch: at most the batch
    pool = settings(engine)["pool"]
    assert pool["cache_memory_bytes"] == 8192
    assert pool["blocks_total"] == 8192 // pool["bytes_per_block"]
    by_old_name = Engine(model, block_size=4, max_model_len=40, cache_memory_bytes=8192, max_batch_size=5)
    assert settings(by_old_name)["pool"] == pool
    assert by_old_name.config.kv_cache_memory_bytes == 8192


def test_max_model_len_is_checked_against_the_models_context(backend):
    model = backend.stub()
    model.max_position_embeddings = 32
    engine = Engine(model, config=EngineConfig(block_size=4, kv_cache_memory_bytes=8192))
    assert (engine.max_model_len, engine.config.max_model_len) == (32, None)  # None: the model's context
    with pytest.raises(ValueError) as raised:
        Engine(model, config=EngineConfig(max_model_len=33))
    context = "max_model_len=33 is more than the model's context of 32 positions (max_position_embeddings)"
    assert str(raised.value) == context


def test_max_prefill_tokens_still_warns_and_sets_the_step_budget(model):
    with pytest.warns(DeprecationWarning, match="max_num_batched_tokens") as caught:
        engine = Engine(model, max_prefill_tokens=64, block_size=4, cache_memory_bytes=8192)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert engine._scheduler.max_num_batched_tokens == engine.config.max_num_batched_tokens == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine(model, max_prefill_tokens=None, block_size=4, cache_memory_bytes=8192)  # its old default
    assert engine.config.max_num_batched_tokens == 2048


# ---- hyper-gen serve ------------------------------------------------------------------------------


def test_serve_aliases_vllm_flag_names():
    from hyper_gen.cli.main import build_parser

    parser = build_parser()
    ours = parser.parse_args(["serve", "--max-batch-size", "3", "--cache-memory-bytes", "4096"])
    vllm = parser.parse_args(["serve", "--max-num-seqs", "3", "--kv-cache-memory-bytes", "4096"])
    assert (vllm.max_batch_size, vllm.cache_memory_bytes) == (ours.max_batch_size, ours.cache_memory_bytes) == (3, 4096)


def test_serve_passes_its_flags_as_one_config_and_a_refusal_is_one_line(cli, monkeypatch):
    import hyper_gen.cli.serve as serve

    made = []

    class Refusing:
        def __init__(self, model, tokenizer=None, config=None, **overrides):
            made.append((config, overrides))
            raise ValueError("refused here")

    monkeypatch.setattr(serve, "Engine", Refusing)
    flags = ["--max-num-seqs", "3", "--max-model-len", "64", "--block-size", "8", "--no-enable-prefix-caching"]
    result = cli(["serve", "--port", "0", *flags, "--max-num-batched-tokens", "128", "--kv-cache-memory-bytes", "4096"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == ["hyper-gen: error: refused here"]
    assert made == [
        (
            EngineConfig(
                max_num_seqs=3,
                max_model_len=64,
                block_size=8,
                enable_prefix_caching=False,
                max_num_batched_tokens=128,
                kv_cache_memory_bytes=4096,
            ),
            {},
        )
    ]


def test_serve_bad_values_under_vllm_flag_names_are_one_line_errors(cli):
    result = cli(["serve", "--max-num-seqs", "0"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["hyper-gen: error: --max-batch-size must be >= 1, got 0"]
