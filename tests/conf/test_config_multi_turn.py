"""verl's multi_turn keys: the tool config is read and checked when the config loads (every mistake
named with its file and tool), the keys ppoflow does not implement are refused, and multi-turn keys
of a run that does not enable it are named as without effect."""

import re
from pathlib import Path

import pytest

from ppoflow.conf import ConfigError, load_config
from ppoflow.conf.tool_config import read_tool_config

from .micro import MICRO

ROOT = Path(__file__).resolve().parents[2]
ENABLE = "actor_rollout_ref.rollout.multi_turn.enable=true"


def tool_config(tmp_path, text: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    return path


SCHEMA = "    tool_schema: {type: function, function: {name: %s}}\n"


def test_the_shipped_configs_read_as_their_tools():
    (calculator,) = read_tool_config(str(ROOT / "conf/tools/calculator.yaml"))
    assert (calculator.name, calculator.class_name, calculator.module_file) == (
        "calculator",
        "ppoflow:calculator",
        None,
    )
    cfg = load_config(str(ROOT / "conf/tool_calculator.yaml"), check_paths=False)
    section = cfg.actor_rollout_ref.rollout.multi_turn
    assert section.enable and section.tool_config_path == str(ROOT / "conf/tools/calculator.yaml")


def test_a_users_tool_is_located_not_imported(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "weather.py").write_text("raise SystemExit('imported at config time')\n")
    (tmp_path / "mine.py").write_text("class Tool: pass\n")
    path = tool_config(
        tmp_path,
        "tools:\n  - class_name: pkg.weather.Weather\n"
        + SCHEMA % "weather"
        + "  - class_name: mine.py:Tool\n    config: {type: native, k: 1}\n"
        + SCHEMA % "mine",
    )
    weather, mine = read_tool_config(str(path))
    assert (weather.module_file, weather.attribute) == (str(tmp_path / "pkg" / "weather.py"), "Weather")
    assert (mine.module_file, mine.attribute, mine.config) == (
        str(tmp_path / "mine.py"),
        "Tool",
        {"type": "native", "k": 1},
    )
    assert len(mine.source_digest) == 64


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tools: [", "not YAML"),
        ("- a\n", "a list under 'tools'"),
        ("tools:\n  - 3\n", "tools[0]: expected a mapping"),
        (
            "tools:\n  - class_name: ppoflow:calculator\n    extra: 1\n" + SCHEMA % "c",
            "unknown keys ['extra']",
        ),
        ("tools:\n  - class_name: ppoflow:calculator\n", "tool_schema must be"),
        ("tools:\n  - class_name: ppoflow:calculator\n" + SCHEMA % "'a b'", "tool name 'a b'"),
        (
            "tools:\n  - class_name: ppoflow:calculator\n    config: {type: mcp}\n" + SCHEMA % "c",
            "only native",
        ),
        ("tools:\n  - class_name: calculator\n" + SCHEMA % "c", "neither a built-in tool"),
        ("tools:\n  - class_name: nowhere.py:Tool\n" + SCHEMA % "c", "no file"),
        (
            "tools:\n  - class_name: ppoflow:calculator\n    config: {type: native, since: 2024-01-01}\n"
            + SCHEMA % "c",
            "config holds a value that is not JSON",
        ),
        (
            "tools:\n  - class_name: ppoflow:calculator\n    config: {type: native, since: 2024-01-01}\n"
            + SCHEMA % "c",
            "config holds a value that is not JSON",
        ),
        (
            "tools:\n  - class_name: ppoflow:calculator\n"
            + SCHEMA % "c"
            + "  - class_name: ppoflow:calculator\n"
            + SCHEMA % "c",
            "two tools are named 'c'",
        ),
    ],
)
def test_tool_config_mistakes_are_named_with_the_file(tmp_path, text, message):
    path = tool_config(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        load_config(None, [*MICRO, ENABLE, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}"])
    assert str(path) in str(raised.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor_rollout_ref.rollout.multi_turn.interaction_config_path=x.yaml",
            "interactions are not implemented",
        ),
        ("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=2", "not implemented"),
        ("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true", "as generated"),
        ("algorithm.adv_estimator=remax", "greedy baseline"),
        ("actor_rollout_ref.actor.use_prefix_grouper=true", "use_prefix_grouper=false"),
        ("actor_rollout_ref.rollout.multi_turn.format=llama3_json", "hermes"),
    ],
)
def test_what_ppoflow_does_not_implement_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*MICRO, ENABLE, override], check_paths=False)


def test_a_tool_weight_needs_multi_turn():
    with pytest.raises(ConfigError, match="reward.weights.tool"):
        load_config(None, [*MICRO, "reward.weights.tool=1.0"], check_paths=False)
    load_config(None, [*MICRO, ENABLE, "reward.weights.tool=1.0"], check_paths=False)


def test_multi_turn_keys_without_enable_have_no_effect():
    cfg = load_config(
        None, [*MICRO, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"], check_paths=False
    )
    warning = cfg.no_effect_warning()
    assert "actor_rollout_ref.rollout.multi_turn.max_assistant_turns" in warning and "enable=false" in warning


@pytest.mark.parametrize("folder", ["repository", "elsewhere"])
def test_a_tool_class_is_found_beside_its_config_wherever_the_command_runs(tmp_path, monkeypatch, folder):
    """`ppoflow:nosuch` passed from the repository's root, where ppoflow/__init__.py made it a user's
    module (imported by the tool worker at the first rollout), and was refused elsewhere; a module
    that is only in the working directory was found there. A name in ppoflow's or verl's namespace is
    a built-in or an error, and a user's module is looked for beside the tool config only."""
    monkeypatch.chdir(ROOT if folder == "repository" else tmp_path)
    (tmp_path / "cwd_only.py").write_text("class Tool: pass\n")  # found only from tmp_path as cwd
    configs = tmp_path / "configs"
    configs.mkdir()
    cases = {
        "ppoflow:nosuch": "is not one of ppoflow's built-in tools (ppoflow:calculator, ppoflow:gsm8k_answer",
        "ppoflow.cli:main": "is not one of ppoflow's built-in tools",
        "verl.tools.search_tool.SearchTool": "is not one of ppoflow's built-in tools",
        "cwd_only:Tool": f"no file {configs / 'cwd_only.py'} (a user's tool is a Python file beside the tool",
    }
    for class_name, message in cases.items():
        path = tool_config(configs, f"tools:\n  - class_name: {class_name}\n" + SCHEMA % "c")
        with pytest.raises(ConfigError, match=re.escape(message)):
            read_tool_config(str(path))


@pytest.mark.parametrize("tools", ["unset", "empty"])
def test_multi_turn_without_tools_is_refused(tmp_path, tools):
    """multi_turn.enable=true with `tools: []`, or no tool config, trained without a word: every call
    answered "unknown tool" (validation 0.46 → 0.02 in one run)."""
    overrides = [*MICRO, ENABLE]
    if tools == "empty":
        overrides.append(
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config(tmp_path, 'tools: []')}"
        )
    with pytest.raises(ConfigError, match="a multi-turn rollout without tools answers every call") as raised:
        load_config(None, overrides)
    assert ("lists no tools" if tools == "empty" else "tool_config_path is unset") in str(raised.value)
