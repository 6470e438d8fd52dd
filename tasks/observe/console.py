"""Terminal output: progress for generation and updates, one line per iteration.

Every line is printed on stdout and, inside a Prefect flow or task run, sent to that run's log (the
Logs tab of the UI). Progress is a transient bar on an interactive terminal; without one (a worker,
nohup, a pipe) a stage that runs longer than PPOFLOW_PROGRESS_INTERVAL seconds (30) prints a
progress line that often instead. PPOFLOW_PROGRESS=1 draws bars anyway, PPOFLOW_PROGRESS=0 shows
no progress.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ppoflow.tasks.observe.invocation import ppoflow_command

console = Console(highlight=False, markup=False, emoji=False)  # what it says is plain text: paths, values
log = logging.getLogger("ppoflow.console")
RUN_LOGGER = "ppoflow.run_log"
"""The logger name the lines carry on a Prefect run's Logs tab."""
_api_handler: logging.Handler | None = None

PROGRESS_INTERVAL_S = 30.0
UNITS = {"generate": "responses", "validate": "answers", "update": "optimizer steps"}
"""What progress counts, by the last word of a stage's description."""


SWITCH = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def _progress_mode() -> str:
    flag = os.environ.get("PPOFLOW_PROGRESS")
    if flag is not None and flag.strip().lower() in SWITCH:
        return "bar" if SWITCH[flag.strip().lower()] else "off"
    if flag is not None:
        _warn_once(f"PPOFLOW_PROGRESS={flag!r} is not 1 or 0 (true/false, yes/no, on/off); ignored")
    return "bar" if sys.stdout.isatty() else "lines"


@functools.cache
def _warn_once(text: str) -> None:
    """A line on stderr (and in the run's log file), once per process."""
    Console(stderr=True, highlight=False, markup=False, emoji=False).print(f"ppoflow: {text}", soft_wrap=True)
    log.warning(text)


class StageProgress:
    """What a long stage reports as it runs: `progress(count)` when `count` more units (responses,
    optimizer steps) are done, `progress.tokens(count)` when `count` more tokens are generated."""

    def __call__(self, count: int) -> None:
        pass

    def tokens(self, count: int) -> None:
        pass


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Iterator[StageProgress]:
    """A transient bar on a terminal, progress lines elsewhere, nothing when turned off."""
    match _progress_mode():
        case "bar":
            with _bar(description, total) as progress:
                yield progress
        case "lines":
            yield ProgressLines(description, total, _progress_interval())
        case _:
            yield StageProgress()


def _progress_interval() -> float:
    value = os.environ.get("PPOFLOW_PROGRESS_INTERVAL")
    try:
        interval = float(value) if value is not None else PROGRESS_INTERVAL_S
    except ValueError:
        interval = math.nan
    if not 0 <= interval < math.inf:
        _warn_once(
            f"PPOFLOW_PROGRESS_INTERVAL={value!r} is not a number of seconds; using {PROGRESS_INTERVAL_S:g}"
        )
        return PROGRESS_INTERVAL_S
    return interval


class _Bar(StageProgress):
    def __init__(self, progress: Progress, task_id):
        self.progress, self.task_id, self.generated = progress, task_id, 0

    def __call__(self, count: int) -> None:
        self.progress.advance(self.task_id, count)

    def tokens(self, count: int) -> None:
        self.generated += count
        self.progress.update(self.task_id, tokens=f"{self.generated:,} tokens")


@contextlib.contextmanager
def _bar(description: str, total: int) -> Iterator[StageProgress]:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        yield _Bar(progress, progress.add_task(description, total=total, tokens=""))


class ProgressLines(StageProgress):
    """Progress without a terminal: says how far the stage is at most every `interval` seconds, the
    first time once it has run that long (so a short stage says nothing). Generation counts tokens
    too, so that a batch of long answers shows its rate before its first response is finished."""

    def __init__(self, description: str, total: int, interval: float):
        self.description, self.total, self.interval = description, total, interval
        self.unit = UNITS.get(description.rsplit(" ", 1)[-1], "done")
        self.done = self.generated = 0
        self.started = self.said = time.monotonic()

    def __call__(self, count: int) -> None:
        self.done += count
        self._maybe_say()

    def tokens(self, count: int) -> None:
        self.generated += count
        self._maybe_say()

    def _maybe_say(self) -> None:
        now = time.monotonic()
        if now - self.said < self.interval:
            return
        self.said, elapsed = now, now - self.started
        line = f"{self.description}: {self.done}/{self.total} {self.unit}"
        if self.generated:
            line += f", {self.generated:,} tokens ({self.generated / max(elapsed, 1e-9):,.0f}/s)"
        line += f", {elapsed:.0f} s"
        if 0 < self.done < self.total:
            line += f", ETA {elapsed / self.done * (self.total - self.done):.0f} s"
        say(line)


def say(text: str) -> None:
    """A line for the user: on stdout, in the run's log file when one is open (`ppoflow train`), and
    in the Prefect run log of the flow or task run it is said in."""
    console.print(text, soft_wrap=True)
    log.info(text)
    _to_run_log(text.lstrip("\n"))


def _to_run_log(text: str) -> None:
    """Inside a Prefect flow or task run, to that run's log, handed to Prefect's API log handler
    directly: Prefect's run loggers (or any handler a logger has) would print it a second time."""
    global _api_handler
    if "prefect" not in sys.modules:  # no run without Prefect (`ppoflow report` need not import it)
        return
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger
    from prefect.logging.handlers import APILogHandler

    try:
        run = get_run_logger()
    except MissingContextError:
        return
    if isinstance(run, logging.LoggerAdapter) and run.extra:  # ids of the flow run and task run
        _api_handler = _api_handler or APILogHandler()
        record = logging.LogRecord(RUN_LOGGER, logging.INFO, __file__, 0, text, None, None)
        record.__dict__.update(run.extra)
        _api_handler.handle(record)


EXAMPLE_QUERY = "SELECT iter, avg(score) FROM rewards GROUP BY iter ORDER BY iter"
VALIDATION_QUERY = "SELECT iter, data_source, avg(score) FROM validation GROUP BY ALL ORDER BY ALL"
"""The query to try on a run that only validated (trainer.val_only): it has no rewards rows."""


def show_generations(step: int, rows: list[dict]) -> None:
    """trainer.log_val_generations: a few validation samples (all are in the validation table)."""
    for row in rows:
        prompt = " ".join(row["prompt_text"].split())[-70:]
        response = " ".join(row["response_text"].split())[:160]
        say(f"  val sample (step {step}, score {row['score']:.2f}) …{prompt} ⟶ {response}")


def _fmt(metrics: dict[str, float], key: str, spec: str = ".3f") -> str:
    value = metrics.get(key)
    return "—" if value is None else format(value, spec)


_REWARD_MEAN = re.compile(r"val-(?:core|aux)/(.+)/reward/mean@(\d+)")


def validation_score(metrics: dict[str, float]) -> float | None:
    """The headline validation score: the mean over data sources of the reward's mean@n at each
    source's largest n (val-core's, or val-aux's when the reward has an acc component, which verl
    makes the core variable)."""
    largest: dict[str, tuple[int, float]] = {}
    for key, value in metrics.items():
        found = _REWARD_MEAN.fullmatch(key)
        if found and int(found[2]) >= largest.get(found[1], (0, 0.0))[0]:
            largest[found[1]] = (int(found[2]), value)
    scores = [value for _, value in largest.values()]
    return sum(scores) / len(scores) if scores else None


REFERENCE_KL = ("actor/kl_loss", "actor/reward_kl_penalty")
"""KL(actor ‖ reference) per token, of the KL loss (use_kl_loss) or of the in-reward penalty
(use_kl_in_reward); the console's ref_kl is the first of them a run logs."""


def _reference_kl(metrics: dict[str, float]) -> list[str]:
    return [key for key in REFERENCE_KL if metrics.get(key) is not None][:1]


def report_iteration(step: int, total: int, result, *, seconds: float | None) -> dict[str, float]:
    """One readable line per iteration: val score, reward mean, ppo_kl (how far the update moved the
    policy from the one that sampled), ref_kl (KL to the reference, when the run has one), clipfrac,
    and the seconds it took in this process, or "cached" (seconds None) when every stage came from
    cache."""
    metrics = dict(result.values)
    val = validation_score(metrics)
    accuracy = [v for k, v in metrics.items() if k.startswith("val-aux/") and "/correctness/mean@" in k]
    parts = [f"step {step:>3}/{total}"]
    parts.append(f"val {val:.3f}" if val is not None else "val   —  ")
    if accuracy:
        parts[-1] += f" (correct {sum(accuracy) / len(accuracy):.2f})"
    if "critic/score/mean" in metrics:  # a training step (a validation on its own has no rewards)
        parts += [
            f"reward {_fmt(metrics, 'critic/score/mean')}",
            f"ppo_kl {_fmt(metrics, 'actor/ppo_kl', '.4f')}",
            *[f"ref_kl {metrics[key]:.4f}" for key in _reference_kl(metrics)],
            f"clipfrac {_fmt(metrics, 'actor/pg_clipfrac')}",
            "cached" if seconds is None else f"{seconds:.1f}s",
        ]
    say(" · ".join(parts))
    return metrics | {"wall_time": time.time()}


def report_run(run, actor, history: list[dict[str, float]], *, validation_only: bool = False) -> dict:
    """Where the data is, how to browse it and a query to try; returns a small summary."""
    checkpoint = run.path / actor.checkpoint if actor.checkpoint else None
    say(f"\nrun directory   {run.path}")
    say(f"final actor     {checkpoint}")
    say(f"catalog         {run.path / 'catalog.duckdb'}")
    say(f"browse          {ppoflow_command()} explore {shlex.quote(str(run.path))}")
    example = VALIDATION_QUERY if validation_only else EXAMPLE_QUERY
    query = f'{ppoflow_command()} query {shlex.quote(str(run.path))} "{example}"'  # runs/it's
    say(f"try             {query}")
    scores = [validation_score(m) for m in history]
    return {
        "run_dir": str(run.path),
        "actor_checkpoint": str(checkpoint) if checkpoint else None,
        "val_scores": [s for s in scores if s is not None],
        "validation": [[m["step"], s] for m, s in zip(history, scores, strict=True) if s is not None],
        "steps": len(history),
        "wall_times": [m["wall_time"] for m in history],
    }
