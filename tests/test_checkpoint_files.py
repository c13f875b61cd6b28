"""No checkpoint file a user points at breaks hyper_gen: every corrupt, unreadable or inconsistent
file is a ValueError naming the file and what is wrong, raised by ``load_model`` before any model
is built, with the same message on torch and MindSpore (the checks live in the shared
``Checkpoint`` / Qwen3.5 config code).

Each case corrupts a copy of the bundled demo model (a tiny Qwen3.5, 4 layers, vocab 99).
"""

import builtins
import json
import os
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hyper_gen.models.checkpoint as checkpoint_module
from hyper_gen import load_model
from hyper_gen.demo import demo_model_path
from hyper_gen.models.checkpoint import Checkpoint, Piece

BACKENDS = pytest.mark.parametrize("backend", ["torch", "mindspore"])
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"
VOCAB = 99  # the demo model's vocab_size


# ------------------------------------------------------------------------------ helpers


def demo_copy(tmp_path, name="model"):
    target = os.path.join(tmp_path, name)
    shutil.copytree(demo_model_path(), target)
    return target


def edit_json(path, file, **changes):
    """Set (or, with None, remove) top-level fields of ``file`` in ``path``."""
    full = os.path.join(path, file)
    with open(full, encoding="utf-8") as f:
        data = json.load(f)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    with open(full, "w", encoding="utf-8") as f:
        json.dump(data, f)


def edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def shard(path):
    """Rewrite ``path``'s single model.safetensors as two shards and an index; returns the shard files."""
    single = os.path.join(path, "model.safetensors")
    tensors = load_file(single)
    os.remove(single)
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for file, half in zip(files, halves):
        save_file({n: tensors[n] for n in half}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in half})
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return [os.path.join(path, file) for file in files]


def load_error(path, backend, kind=ValueError) -> str:
    with pytest.raises(kind) as info:
        load_model(path, backend=backend)
    message = str(info.value)
    assert "\n" not in message  # the CLI prints it as one line
    return message


def assert_names(message, *parts):
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# ------------------------------------------------------------------------------ 1. integer dtype


@BACKENDS
@pytest.mark.parametrize("np_dtype, stored", [("int32", "I32"), ("int8", "I8")])
def test_floating_weight_stored_as_integer(tmp_path, backend, np_dtype, stored):
    path = demo_copy(tmp_path)
    edit_tensors(path, lambda t: t.update({Q_PROJ: (t[Q_PROJ] * 100).astype(np_dtype)}))
    message = load_error(path, backend)
    assert_names(message, repr(Q_PROJ), f"stored as {stored}", os.path.join(path, "model.safetensors"))
    assert "F16, BF16, F32 or F64" in message


def test_integer_tensor_still_reads_as_integer(tmp_path):
    """Only a floating read of an integer tensor is refused: an integer read is the caller's choice."""
    path = demo_copy(tmp_path)
    edit_tensors(path, lambda t: t.update({"extra.counts": np.arange(6, dtype=np.int32)}))
    assert Checkpoint(path).get("extra.counts", "int64").tolist() == list(range(6))


# ------------------------------------------------------------------------------ 2. NaN / inf


@BACKENDS
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weight(tmp_path, backend, value):
    path = demo_copy(tmp_path)

    def poison(tensors):
        tensors[Q_PROJ] = tensors[Q_PROJ].copy()
        tensors[Q_PROJ][3, 5] = value

    edit_tensors(path, poison)
    message = load_error(path, backend)
    assert_names(message, repr(Q_PROJ), "non-finite", os.path.join(path, "model.safetensors"))
    assert ("1 NaN, 0 inf" if np.isnan(value) else "0 NaN, 1 inf") in message


@BACKENDS
def test_float64_weight_past_float32_range(tmp_path, backend):
    """A float64 value a float32 model cannot hold becomes inf when read: reported, not loaded."""
    path = demo_copy(tmp_path)

    def widen(tensors):
        tensors[Q_PROJ] = tensors[Q_PROJ].astype(np.float64)
        tensors[Q_PROJ][0, 0] = 1e300

    edit_tensors(path, widen)
    assert_names(load_error(path, backend), repr(Q_PROJ), "non-finite", "inf as float32")


def test_non_finite_found_in_a_slice(tmp_path):
    """A tensor-parallel rank reads slices; a NaN in its slice is found, one outside it is another rank's."""
    path = demo_copy(tmp_path)

    def poison(tensors):
        tensors[Q_PROJ] = tensors[Q_PROJ].copy()
        tensors[Q_PROJ][-1, 0] = np.nan

    edit_tensors(path, poison)
    checkpoint = Checkpoint(path)
    rows = checkpoint.shape(Q_PROJ)[0]
    assert checkpoint.read(Piece(Q_PROJ, checkpoint.shape(Q_PROJ), 0, ((0, rows // 2),))).shape[0] == rows // 2
    with pytest.raises(ValueError, match="non-finite"):
        checkpoint.read(Piece(Q_PROJ, checkpoint.shape(Q_PROJ), 0, ((rows // 2, rows),)))
    with pytest.raises(ValueError, match="non-finite"):
        checkpoint.get_slice(Q_PROJ, 0, rows - 1, rows, "float64")


# ------------------------------------------------------------------------------ 3. corrupt safetensors


def _truncate(file):
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2])


def _garbage(file):
    with open(file, "wb") as f:
        f.write(b"this is not a safetensors file at all")


def _empty(file):
    open(file, "wb").close()


CORRUPTIONS = pytest.mark.parametrize("corrupt", [_truncate, _garbage, _empty], ids=["truncated", "garbage", "empty"])


@BACKENDS
@CORRUPTIONS
def test_corrupt_single_safetensors(tmp_path, backend, corrupt):
    path = demo_copy(tmp_path)
    file = os.path.join(path, "model.safetensors")
    corrupt(file)
    assert_names(load_error(path, backend), file, "not a valid safetensors file")


@BACKENDS
@CORRUPTIONS
def test_corrupt_shard(tmp_path, backend, corrupt):
    path = demo_copy(tmp_path)
    second = shard(path)[1]
    corrupt(second)
    assert_names(load_error(path, backend), second, "not a valid safetensors file")


@BACKENDS
def test_index_names_tensor_its_shard_lacks(tmp_path, backend):
    path = demo_copy(tmp_path)
    first, second = shard(path)
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index, encoding="utf-8") as f:
        data = json.load(f)
    moved = next(name for name, file in data["weight_map"].items() if file == os.path.basename(second))
    data["weight_map"][moved] = os.path.basename(first)
    with open(index, "w", encoding="utf-8") as f:
        json.dump(data, f)
    assert_names(load_error(path, backend), index, repr(moved), first, "does not hold it")


def test_sharded_demo_loads(tmp_path):
    """The sharding helper itself is sound: the sharded copy reads the same tensors."""
    path = demo_copy(tmp_path)
    expected = Checkpoint(path).get(Q_PROJ)
    shard(path)
    np.testing.assert_array_equal(Checkpoint(path).get(Q_PROJ), expected)


# ------------------------------------------------------------------------------ 4. bad JSON


JSON_FILES = ["config.json", "generation_config.json", "model.safetensors.index.json"]


def _prepare(path, file):
    if file == "model.safetensors.index.json":
        shard(path)
    return os.path.join(path, file)


@BACKENDS
@pytest.mark.parametrize("file", JSON_FILES)
def test_bad_json_names_file_line_and_column(tmp_path, backend, file):
    path = demo_copy(tmp_path)
    full = _prepare(path, file)
    with open(full, "w", encoding="utf-8") as f:
        f.write('{\n  "vocab_size": 99,\n  "oops" 1\n}\n')
    message = load_error(path, backend)
    assert_names(message, full, "not valid JSON", "line 3 column 10")


@BACKENDS
@pytest.mark.parametrize("file", JSON_FILES)
def test_json_file_not_utf8(tmp_path, backend, file):
    path = demo_copy(tmp_path)
    full = _prepare(path, file)
    with open(full, "wb") as f:
        f.write(b'{"x": "\xff\xfe"}')
    assert_names(load_error(path, backend), full, "not UTF-8")


# ------------------------------------------------------------------------------ 5. JSON not an object


@BACKENDS
@pytest.mark.parametrize("file", JSON_FILES)
@pytest.mark.parametrize("value, kind", [([1, 2], "a list"), ("text", "a string"), (3, "a number"), (None, "null")])
def test_json_file_not_an_object(tmp_path, backend, file, value, kind):
    path = demo_copy(tmp_path)
    full = _prepare(path, file)
    with open(full, "w", encoding="utf-8") as f:
        json.dump(value, f)
    assert_names(load_error(path, backend), full, "must hold a JSON object", kind)


@BACKENDS
@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"architectures": "Qwen3_5ForCausalLM"}, "'architectures' must be a list of strings"),
        ({"text_config": [1]}, "'text_config' must be a JSON object"),
    ],
)
def test_config_structure_errors_name_the_file(tmp_path, backend, changes, expected):
    path = demo_copy(tmp_path)
    edit_json(path, "config.json", **changes)
    assert_names(load_error(path, backend), os.path.join(path, "config.json"), expected)


@BACKENDS
@pytest.mark.parametrize("weight_map", [None, [1], {"model.norm.weight": 3}])
def test_index_without_a_weight_map(tmp_path, backend, weight_map):
    path = demo_copy(tmp_path)
    index = _prepare(path, "model.safetensors.index.json")
    with open(index, "w", encoding="utf-8") as f:
        json.dump({"metadata": {}} if weight_map is None else {"weight_map": weight_map}, f)
    assert_names(load_error(path, backend), index, "'weight_map' object")


# ------------------------------------------------------------------------------ 6. layers past num_hidden_layers


@BACKENDS
def test_checkpoint_layers_beyond_num_hidden_layers(tmp_path, backend):
    path = demo_copy(tmp_path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        layer_types = json.load(f)["layer_types"]
    edit_json(path, "config.json", num_hidden_layers=2, layer_types=layer_types[:2])
    message = load_error(path, backend)
    assert_names(
        message,
        "has tensors for layer 3",
        "num_hidden_layers 2",
        os.path.join(path, "config.json"),
        os.path.join(path, "model.safetensors"),
    )


@BACKENDS
def test_fewer_layers_in_checkpoint_is_a_missing_tensor(tmp_path, backend):
    path = demo_copy(tmp_path)
    edit_tensors(path, lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.3.")])
    assert_names(load_error(path, backend), "missing tensor 'model.layers.3.")


# ------------------------------------------------------------------------------ 7. unreadable files


READABLE_FILES = ["config.json", "generation_config.json", "model.safetensors"]


@BACKENDS
@pytest.mark.parametrize("file", READABLE_FILES)
def test_file_is_a_directory(tmp_path, backend, file):
    path = demo_copy(tmp_path)
    full = os.path.join(path, file)
    os.remove(full)
    os.mkdir(full)
    assert_names(load_error(path, backend), f"cannot read {full}: ", "Is a directory")


@BACKENDS
@pytest.mark.parametrize("file", READABLE_FILES + ["model-00002-of-00002.safetensors"])
def test_file_is_a_dangling_symlink(tmp_path, backend, file):
    path = demo_copy(tmp_path)
    if file.startswith("model-"):
        shard(path)
    full = os.path.join(path, file)
    os.remove(full)
    os.symlink(os.path.join(tmp_path, "gone"), full)
    assert_names(load_error(path, backend), f"cannot read {full}: ", "dangling symlink", "gone")


@BACKENDS
@pytest.mark.parametrize("file", READABLE_FILES)
def test_file_without_read_permission(tmp_path, backend, file, monkeypatch):
    """chmod 000 (simulated: the tests may run as root, who reads everything): the OS's reason is reported."""
    path = demo_copy(tmp_path)
    full = os.path.join(path, file)

    def guarded_open(name, *args, **kwargs):
        if os.fspath(name) == full:
            raise PermissionError(13, "Permission denied", full)
        return builtins.open(name, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "open", guarded_open, raising=False)
    assert_names(load_error(path, backend), f"cannot read {full}: Permission denied")


# ------------------------------------------------------------------------------ 8. token ids outside the vocabulary


@BACKENDS
@pytest.mark.parametrize(
    "file, field, value",
    [
        ("generation_config.json", "pad_token_id", VOCAB),
        ("generation_config.json", "eos_token_id", VOCAB + 20),
        ("generation_config.json", "eos_token_id", [1, VOCAB]),
        ("generation_config.json", "pad_token_id", -1),
        ("config.json", "pad_token_id", VOCAB),  # the fallback when generation_config.json has none
        ("config.json", "eos_token_id", [VOCAB + 1]),
    ],
)
def test_token_id_outside_vocab(tmp_path, backend, file, field, value):
    path = demo_copy(tmp_path)
    if file == "config.json":
        edit_json(path, "generation_config.json", **{field: None})
    edit_json(path, file, **{field: value})
    message = load_error(path, backend)
    assert_names(message, os.path.join(path, file), field, f"vocab_size is {VOCAB}", f"[0, {VOCAB})")


@BACKENDS
@pytest.mark.parametrize(
    "field, value, kind",
    [("pad_token_id", "0", "an int"), ("pad_token_id", [0], "an int"), ("eos_token_id", [1, 2.5], "list of ints")],
)
def test_token_id_of_wrong_type(tmp_path, backend, field, value, kind):
    path = demo_copy(tmp_path)
    edit_json(path, "generation_config.json", **{field: value})
    assert_names(load_error(path, backend), os.path.join(path, "generation_config.json"), field, kind)


def test_overridden_config_token_id_is_not_checked(tmp_path):
    """generation_config.json's id is the one generate() uses; config.json's is then only HF's fallback."""
    path = demo_copy(tmp_path)
    edit_json(path, "config.json", pad_token_id=VOCAB + 5)
    Checkpoint(path).check_token_ids(VOCAB)


# ------------------------------------------------------------------------------ 9. config fields of the wrong type


@BACKENDS
@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"vocab_size": "99"}, "config.json field 'vocab_size' must be an int, got '99'"),
        ({"vocab_size": None}, "config.json is missing field 'vocab_size'"),
        ({"num_hidden_layers": 4.0}, "config.json field 'num_hidden_layers' must be an int"),
        ({"rms_norm_eps": "tiny"}, "config.json field 'rms_norm_eps' must be a finite number"),
        ({"rope_parameters": [1, 2]}, "config.json field 'rope_parameters' must be an object"),
        ({"layer_types": "linear_attention"}, "config.json field 'layer_types' must be a list"),
    ],
)
def test_config_field_of_wrong_type(tmp_path, backend, changes, expected):
    path = demo_copy(tmp_path)
    edit_json(path, "config.json", **changes)
    assert_names(load_error(path, backend), f"checkpoint {path!r}: {expected}")


# ------------------------------------------------------------------------------ same message on both backends


def _missing_tensor(path):
    edit_tensors(path, lambda t: t.pop("model.layers.2.linear_attn.in_proj_z.weight"))


def _misshaped_tensor(path):
    edit_tensors(path, lambda t: t.update({Q_PROJ: t[Q_PROJ][:-1].copy()}))


def _misshaped_embedding(path):
    name = "model.embed_tokens.weight"
    edit_tensors(path, lambda t: t.update({name: t[name][:-1].copy()}))


def _integer_weight(path):
    edit_tensors(path, lambda t: t.update({Q_PROJ: t[Q_PROJ].astype(np.int32)}))


def _nan_norm(path):
    edit_tensors(path, lambda t: t.update({"model.norm.weight": np.full_like(t["model.norm.weight"], np.nan)}))


@pytest.mark.parametrize(
    "corrupt, expected",
    [
        (_missing_tensor, "missing tensor 'model.layers.2.linear_attn.in_proj_z.weight'"),
        (_misshaped_tensor, f"'{Q_PROJ}' has shape (255, 128), expected (256, 128)"),
        (_misshaped_embedding, "'model.embed_tokens.weight' has shape (98, 128), expected (99, 128)"),
        (_integer_weight, "stored as I32"),
        (_nan_norm, "'model.norm.weight'"),
    ],
    ids=["missing", "misshaped", "misshaped_embedding", "integer", "nan"],
)
def test_same_message_on_both_backends(tmp_path, corrupt, expected):
    path = demo_copy(tmp_path)
    corrupt(path)
    messages = {backend: load_error(path, backend) for backend in ("torch", "mindspore")}
    assert messages["torch"] == messages["mindspore"], messages
    assert expected in messages["torch"]
    assert re.search(re.escape(repr(path)), messages["torch"])


@BACKENDS
def test_pristine_copy_still_loads(tmp_path, backend):
    model = load_model(demo_copy(tmp_path), backend=backend)
    assert model.generation_defaults["eos_token_id"] == 1 and model.generation_defaults["pad_token_id"] == 0
