"""examples/train_demo_model.py never overwrites a folder with files (the bundled demo model above all)
unless told to with --force; the refusal is argparse's one line, exit 2, before any training."""

import importlib.util
import os

import pytest
from demo_task import DEMO_MODEL_DIR
from launch import REPO


@pytest.fixture(scope="module")
def trainer():
    spec = importlib.util.spec_from_file_location(
        "train_demo_model", os.path.join(REPO, "examples", "train_demo_model.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_is_a_new_folder_in_the_working_directory(trainer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = trainer.parse_args([])
    assert os.path.abspath(args.out) == str(tmp_path / "demo_model")
    assert os.path.realpath(args.out) != os.path.realpath(DEMO_MODEL_DIR)


def test_the_bundled_model_is_refused_without_force(trainer, capsys):
    before = {name: os.path.getmtime(os.path.join(DEMO_MODEL_DIR, name)) for name in os.listdir(DEMO_MODEL_DIR)}
    with pytest.raises(SystemExit) as info:
        trainer.parse_args(["--out", DEMO_MODEL_DIR])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "already holds files" in err and "--force" in err, err
    after = {name: os.path.getmtime(os.path.join(DEMO_MODEL_DIR, name)) for name in os.listdir(DEMO_MODEL_DIR)}
    assert after == before


def test_force_or_an_empty_folder_is_taken(trainer, tmp_path):
    (tmp_path / "empty").mkdir()
    assert trainer.parse_args(["--out", str(tmp_path / "empty")]).out == str(tmp_path / "empty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    assert trainer.parse_args(["--out", str(tmp_path / "full"), "--force"]).force


def test_a_file_is_refused(trainer, tmp_path, capsys):
    (tmp_path / "model").write_text("")
    with pytest.raises(SystemExit) as info:
        trainer.parse_args(["--out", str(tmp_path / "model"), "--force"])
    assert info.value.code == 2 and "is a file" in capsys.readouterr().err
