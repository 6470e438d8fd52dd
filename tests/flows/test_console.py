"""The lines ppoflow prints: one per step, whose KL figures say which KL they are, and progress
lines for long stages when there is no terminal to draw a bar on (a worker, nohup, a pipe)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from ppoflow.tasks.observe.console import _progress_mode, _warn_once, progress_bar, report_iteration

METRICS = {"critic/score/mean": 0.5, "actor/ppo_kl": 0.04, "actor/pg_clipfrac": 0.125}


def _step_line(capsys, **metrics: float) -> str:
    report_iteration(3, 40, SimpleNamespace(values=tuple((METRICS | metrics).items())), seconds=1.25)
    [line] = capsys.readouterr().out.splitlines()
    return line


def test_the_step_line_names_the_policy_kl_and_the_reference_kl_apart(capsys):
    """actor/ppo_kl (old vs new policy) is not the KL to the reference: each has its own label, and
    the reference KL is shown only when the run has one (KL loss or KL in the reward)."""
    plain = "step   3/40 · val   —   · reward 0.500 · ppo_kl 0.0400 · clipfrac 0.125 · 1.2s"
    assert _step_line(capsys) == plain
    with_loss = _step_line(capsys, **{"actor/kl_loss": 0.0123})
    assert with_loss == plain.replace("ppo_kl 0.0400", "ppo_kl 0.0400 · ref_kl 0.0123")
    in_reward = _step_line(capsys, **{"actor/reward_kl_penalty": 0.0021})
    assert in_reward == plain.replace("ppo_kl 0.0400", "ppo_kl 0.0400 · ref_kl 0.0021")


@pytest.fixture
def no_terminal(monkeypatch, capsys):
    """stdout is pytest's capture (not a terminal); PPOFLOW_PROGRESS(_INTERVAL) unset."""
    monkeypatch.delenv("PPOFLOW_PROGRESS", raising=False)
    monkeypatch.delenv("PPOFLOW_PROGRESS_INTERVAL", raising=False)
    _warn_once.cache_clear()  # each test sees its own first warning
    return monkeypatch


def test_without_a_terminal_progress_is_printed_as_lines_at_the_set_interval(no_terminal, capsys):
    """Interval 0: a line at every advance, counting the stage's unit, with an ETA until done."""
    no_terminal.setenv("PPOFLOW_PROGRESS_INTERVAL", "0")
    with progress_bar("step 3 actor update", total=4) as advance:
        for _ in range(4):
            advance(1)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert re.fullmatch(r"step 3 actor update: 1/4 optimizer steps, \d+ s, ETA \d+ s", lines[0])
    assert re.fullmatch(r"step 3 actor update: 4/4 optimizer steps, \d+ s", lines[-1])
    with progress_bar("step 3 generate", total=64) as advance:
        advance(32)
    assert capsys.readouterr().out.startswith("step 3 generate: 32/64 responses, ")


def test_a_stage_shorter_than_the_interval_prints_no_progress(no_terminal, capsys):
    for interval in (None, "3600"):  # the default (30 s) and a set one
        if interval is not None:
            no_terminal.setenv("PPOFLOW_PROGRESS_INTERVAL", interval)
        with progress_bar("step 1 validate", total=100) as advance:
            advance(50)
            advance(50)
    assert capsys.readouterr().out == ""


def test_progress_off_prints_nothing(no_terminal, capsys):
    no_terminal.setenv("PPOFLOW_PROGRESS", "0")
    no_terminal.setenv("PPOFLOW_PROGRESS_INTERVAL", "0")
    with progress_bar("step 1 critic update", total=2) as advance:
        advance(2)
    assert capsys.readouterr().out == ""


def test_generation_progress_lines_count_tokens_before_the_first_response_is_done(no_terminal, capsys):
    """A batch of long answers finishes its responses only at its end: the token count and rate
    show that it is moving."""
    no_terminal.setenv("PPOFLOW_PROGRESS_INTERVAL", "0")
    with progress_bar("step 2 generate", total=256) as progress:
        progress.tokens(256)
        progress.tokens(1024)
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"step 2 generate: 0/256 responses, 256 tokens \([\d,]+/s\), \d+ s", lines[0])
    assert lines[1].startswith("step 2 generate: 0/256 responses, 1,280 tokens (")


@pytest.mark.parametrize("interval", ["soon", "-1", "nan", "inf"])
def test_an_unusable_progress_interval_is_named_once_and_the_default_used(no_terminal, capsys, interval):
    no_terminal.setenv("PPOFLOW_PROGRESS_INTERVAL", interval)
    for _ in range(2):  # two stages: one warning
        with progress_bar("step 1 validate", total=2) as progress:
            progress(2)
    said = capsys.readouterr()
    assert said.out == ""  # 30 s, not 0
    warning = f"ppoflow: PPOFLOW_PROGRESS_INTERVAL={interval!r} is not a number of seconds; using 30"
    assert said.err.splitlines() == [warning]


@pytest.mark.parametrize(
    ("flag", "mode"),
    [("true", "bar"), ("ON", "bar"), ("1", "bar"), ("no", "off"), ("0", "off"), ("auto", "lines")],
)
def test_the_progress_switch_takes_the_usual_spellings(no_terminal, capsys, flag, mode):
    no_terminal.setenv("PPOFLOW_PROGRESS", flag)
    assert _progress_mode() == mode  # stdout is not a terminal here: "lines" unless switched
    refused = f"ppoflow: PPOFLOW_PROGRESS={flag!r} is not 1 or 0 (true/false, yes/no, on/off); ignored"
    assert capsys.readouterr().err.splitlines() == ([refused] if flag == "auto" else [])


def test_a_validation_on_its_own_is_one_val_figure_at_any_step(capsys):
    """A validation-only run of a step-7 checkpoint has no rewards or update: no training figures,
    and no "cached" for a validation it just computed."""
    validated = {"val-core/ppoflow/addition/reward/mean@1": 0.75}
    report_iteration(7, 7, SimpleNamespace(values=tuple(validated.items())), seconds=None)
    assert capsys.readouterr().out == "step   7/7 · val 0.750\n"


def test_a_line_is_printed_as_written_not_read_as_markup(capsys):
    """A config value such as [/data/a.jsonl] once stopped a run: rich read it as a closing tag."""
    from ppoflow.tasks.observe.console import say

    text = "data.train_files: [/data/a.jsonl] → [/data/a.jsonl, /data/b.jsonl]; [bold]x[/bold] :smile:"
    say(text)
    assert capsys.readouterr().out == text + "\n"


def _script(folder, name: str = "ppoflow"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n")
    return folder / name


def test_the_suggested_command_is_ppoflow_as_it_can_be_run(tmp_path, monkeypatch):
    """`.venv/bin/ppoflow` (the README's set-up, not on PATH) is suggested as typed; a ppoflow that
    PATH finds as `ppoflow` is `ppoflow`; another is named by its path; `python -m ppoflow` and a
    flow inside another program suggest the ppoflow beside their Python, else `python -m ppoflow`."""
    from ppoflow.tasks.observe.invocation import ppoflow_command

    venv = _script(tmp_path / "project/.venv/bin").parent
    python = str(venv / "python")
    other = _script(tmp_path / "elsewhere/bin")
    monkeypatch.chdir(tmp_path / "project")

    def command(argv0: str, on_path=None, executable: str = python) -> str:
        return ppoflow_command(argv0, executable, lambda name: str(on_path) if on_path else None)

    assert command(".venv/bin/ppoflow") == ".venv/bin/ppoflow"
    assert command(".venv/bin/ppoflow", on_path=venv / "ppoflow") == ".venv/bin/ppoflow"  # as typed
    assert command(str(venv / "ppoflow"), on_path=venv / "ppoflow") == "ppoflow"  # found on PATH
    assert command(str(venv / "ppoflow"), on_path=other) == str(venv / "ppoflow")
    assert command(str(venv / "ppoflow")) == str(venv / "ppoflow")
    main = "/src/ppoflow/__main__.py"  # python -m ppoflow
    assert command(main) == str(venv / "ppoflow") and command(main, on_path=venv / "ppoflow") == "ppoflow"
    assert command("/usr/bin/prefect", on_path=other) == str(venv / "ppoflow")  # a Prefect worker
    bare = str(tmp_path / "no venv/python3")
    assert command(main, executable=bare) == f"'{bare}' -m ppoflow"  # quoted for the shell
