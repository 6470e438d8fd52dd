"""The run directory is refused at load when a run could not finish in it: DuckDB reads the run's
tables by glob, so no glob character may be in its path, and no component may be longer than the
255 bytes a file name has, so that the error comes before any step has run and written files."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from ppoflow.conf import ConfigError, TrainerConfig, load_config
from tests.conf.test_config_bounds import error_of, expected, ppoflow

GLOB_NAME = (
    "a name without glob characters (*?[]{}) for the run directory runs/<name>: DuckDB reads the run's "
    "tables by glob; to keep this name, set trainer.default_local_dir to a directory without them"
)
GLOB_DIR = "a run directory without glob characters (*?[]{}): DuckDB reads the run's tables by glob"
LONG_NAME = "a name of at most 255 bytes in UTF-8 (it names the folder runs/<name>), got {} bytes"
LONG_DIR = "path components of at most 255 bytes in UTF-8 (the longest file name), got one of {} bytes"


@pytest.mark.parametrize(
    ("value", "name"),
    [("a[1]", "a[1]"), ("run*", "run*"), ("run?", "run?"), ("'{a,b}'", "{a,b}"), ("a]", "a]"), ("x}", "x}")],
)
def test_experiment_name_with_glob_characters_is_refused(value, name):
    override = f"trainer.experiment_name={value}"
    assert error_of(override) == expected(override, repr(name), GLOB_NAME)


def test_experiment_name_with_glob_characters_in_a_config_file_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  experiment_name: 'lr[3e-4]'\n")
    assert error_of(path=path) == (
        f"invalid value 'lr[3e-4]' for 'trainer.experiment_name' (file '{path}'): expected {GLOB_NAME}"
    )


@pytest.mark.parametrize("tail", ["g[1]/run", "runs/*", "x?y", "{a,b}/run"])
def test_default_local_dir_with_glob_characters_is_refused(tmp_path, tail):
    override = f"trainer.default_local_dir={tmp_path}/{tail}"
    assert error_of(override) == expected(override, repr(f"{tmp_path}/{tail}"), GLOB_DIR)


def test_a_glob_character_in_the_name_is_fine_when_the_run_lives_elsewhere(tmp_path):
    # The name then only labels the logger's run.
    cfg = load_config(None, ["trainer.experiment_name=lr[3e-4]", f"trainer.default_local_dir={tmp_path}/r"])
    assert cfg.trainer.experiment_name == "lr[3e-4]" and cfg.run_dir == tmp_path / "r"


def test_a_relative_run_directory_under_a_glob_directory_is_refused(tmp_path, monkeypatch):
    work = tmp_path / "w[1]"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.experiment_name=x"])
    assert str(info.value) == (
        f"run directory 'runs/x' is '{work}/runs/x' from this directory, which has glob characters "
        "(*?[]{}): DuckDB reads the run's tables by glob; run from another directory or set "
        "trainer.default_local_dir to one without them [trainer.experiment_name: command-line override #1 "
        "'trainer.experiment_name=x']"
    )
    assert load_config(None, ["trainer.experiment_name=x"], check_paths=False).run_dir == Path("runs/x")


@pytest.mark.parametrize(("name", "size"), [("a" * 256, 256), ("é" * 128, 256), ("a" * 300, 300)])
def test_experiment_name_longer_than_255_bytes_is_refused(tmp_path, name, size):
    override = f"trainer.experiment_name={name}"
    assert error_of(override) == expected(override, repr(name), LONG_NAME.format(size))
    # Always: the name is refused even when the run directory is elsewhere.
    both = [override, f"trainer.default_local_dir={tmp_path}/r"]
    with pytest.raises(ConfigError, match=r"at most 255 bytes in UTF-8 \(it names"):
        load_config(None, both)


@pytest.mark.parametrize("name", ["a" * 255, "é" * 127])
def test_experiment_name_of_255_bytes_loads(name):
    assert load_config(None, [f"trainer.experiment_name={name}"]).run_dir == Path("runs") / name


def test_default_local_dir_with_a_component_longer_than_255_bytes_is_refused(tmp_path):
    override = f"trainer.default_local_dir={tmp_path}/{'b' * 256}/run"
    assert error_of(override) == expected(override, repr(f"{tmp_path}/{'b' * 256}/run"), LONG_DIR.format(256))
    chosen = load_config(None, [f"trainer.default_local_dir={tmp_path}/{'b' * 255}/run"])
    assert chosen.run_dir == tmp_path / ("b" * 255) / "run"


def test_bad_run_directories_are_refused_when_the_section_is_built_directly():
    with pytest.raises(ValidationError, match=r"without glob characters") as info:
        TrainerConfig(experiment_name="a[1]")
    assert info.value.errors()[0]["loc"] == ("experiment_name",)
    with pytest.raises(ValidationError, match=r"got 300 bytes"):
        TrainerConfig(experiment_name="a" * 300)
    with pytest.raises(ValidationError, match=r"run directory without glob characters"):
        TrainerConfig(default_local_dir="/tmp/g[1]")


@pytest.mark.parametrize("command", ["config", "train"])
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.experiment_name=a[1]", "invalid value 'a[1]' for 'trainer.experiment_name'"),
        ("trainer.default_local_dir={tmp}/g[1]", "DuckDB reads the run's tables by glob"),
        ("trainer.experiment_name=" + "a" * 300, "got 300 bytes"),
        ("trainer.default_local_dir={tmp}/" + "b" * 300, "got one of 300 bytes"),
    ],
)
def test_cli_refuses_bad_run_directories_with_exit_2_before_writing(tmp_path, command, override, message):
    work = tmp_path / "work"
    work.mkdir()
    out = ppoflow(work, command, override.format(tmp=tmp_path))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("ppoflow: ") and message in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert list(work.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_a_run_directory_under_home_is_in_home_not_a_folder_named_tilde(tmp_path, monkeypatch):
    # A shell does not expand "~" after "key=", so ppoflow does, as for every other path key.
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["trainer.default_local_dir=~/runs/sweep-1"])
    assert cfg.run_dir == tmp_path / "runs" / "sweep-1"
