"""Terminal output: progress bars for generation and updates, one line per iteration.

Bars are drawn only on an interactive terminal (or with PPOFLOW_PROGRESS=1), so logs and CI output
stay one readable line per iteration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(highlight=False)
log = logging.getLogger("ppoflow.console")


def _bars_enabled() -> bool:
    flag = os.environ.get("PPOFLOW_PROGRESS")
    return flag == "1" if flag is not None else sys.stdout.isatty()


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yields `advance(count)`; a transient bar on a terminal, nothing elsewhere."""
    if not _bars_enabled():
        yield lambda _count: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task_id = progress.add_task(description, total=total)
        yield lambda count: progress.advance(task_id, count)


def say(text: str) -> None:
    """A line for the user: on stdout, and in the run's log file when one is open (`ppoflow train`)."""
    console.print(text, soft_wrap=True)
    log.info(text)


EXAMPLE_QUERY = "SELECT iter, avg(score) FROM rewards GROUP BY iter ORDER BY iter"


def show_generations(step: int, rows: list[dict]) -> None:
    """trainer.log_val_generations: a few validation samples (all are in the validation table)."""
    for row in rows:
        prompt = " ".join(row["prompt_text"].split())[-70:]
        response = " ".join(row["response_text"].split())[:160]
        say(f"  val sample (step {step}, score {row['score']:.2f}) …{prompt} ⟶ {response}")


def _fmt(metrics: dict[str, float], key: str, spec: str = ".3f") -> str:
    value = metrics.get(key)
    return "—" if value is None else format(value, spec)


def validation_score(metrics: dict[str, float]) -> float | None:
    """Mean of the val-core reward means over data sources (the headline validation score)."""
    scores = [v for k, v in metrics.items() if k.startswith("val-core/") and "/reward/mean@" in k]
    return sum(scores) / len(scores) if scores else None


def report_iteration(step: int, total: int, result, *, seconds: float | None) -> dict[str, float]:
    """One readable line per iteration: val score, reward mean, KL, clipfrac, and the seconds it
    took in this process, or "cached" (seconds None) when every stage came from cache."""
    metrics = dict(result.values)
    val = validation_score(metrics)
    accuracy = [v for k, v in metrics.items() if k.startswith("val-aux/") and "/correctness/mean@" in k]
    parts = [f"step {step:>3}/{total}"]
    parts.append(f"val {val:.3f}" if val is not None else "val   —  ")
    if accuracy:
        parts[-1] += f" (correct {sum(accuracy) / len(accuracy):.2f})"
    if step > 0:
        parts += [
            f"reward {_fmt(metrics, 'critic/score/mean')}",
            f"kl {_fmt(metrics, 'actor/ppo_kl', '.4f')}",
            f"clipfrac {_fmt(metrics, 'actor/pg_clipfrac')}",
            "cached" if seconds is None else f"{seconds:.1f}s",
        ]
    say(" · ".join(parts))
    return metrics | {"wall_time": time.time()}


def report_run(run, actor, history: list[dict[str, float]]) -> dict:
    """Where the data is and a query to try; returns a small summary."""
    checkpoint = run.path / actor.checkpoint if actor.checkpoint else None
    say(f"\nrun directory   {run.path}")
    say(f"final actor     {checkpoint}")
    say(f"catalog         {run.path / 'catalog.duckdb'}")
    say(f'try             ppoflow query {run.path} "{EXAMPLE_QUERY}"')
    scores = [validation_score(m) for m in history]
    return {
        "run_dir": str(run.path),
        "actor_checkpoint": str(checkpoint) if checkpoint else None,
        "val_scores": [s for s in scores if s is not None],
        "validation": [[m["step"], s] for m, s in zip(history, scores, strict=True) if s is not None],
        "steps": len(history),
        "wall_times": [m["wall_time"] for m in history],
    }
