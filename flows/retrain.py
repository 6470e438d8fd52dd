"""The `retrain` flow (scheduled in prefect.yaml): when new data files have arrived, train from the
champion for a few iterations and promote the candidate only if it validates better."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import Field

from ppoflow.conf import load_config
from ppoflow.flows.train import train
from ppoflow.tasks.artifacts import artifact_key
from ppoflow.tasks.console import say
from ppoflow.tasks.lock import acquire_run_lock, release_run_lock
from ppoflow.tasks.retrain import (
    BASE,
    decide,
    find_new_data,
    next_round,
    read_champion,
    record_round,
    refresh_retrain_catalog,
    round_overrides,
    round_scores,
)

take_stock = task(find_new_data, name="find_new_data", cache_policy=NO_CACHE)


@flow(name="retrain", log_prints=False)
def retrain(
    data_dir: str = "data/incoming",
    run_dir: str = "runs/retrain",
    iterations: Annotated[int, Field(gt=0)] = 5,
    min_improvement: Annotated[float, Field(ge=0)] = 0.0,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Retrain on new data, keeping the better model.

    Args:
        data_dir: Folder watched for new .json/.jsonl files (verl's dataset rows); a file whose
            content was taken in before is skipped.
        run_dir: Retraining directory: rounds, promotions table, champion pointer, catalog.
        iterations: PPO iterations per round, continuing from the champion.
        min_improvement: How much the candidate's validation score must beat the champion's by.
        config_file: YAML file of overrides in verl's key names (None: the embedded default).
        overrides: Dotted key=value overrides applied on top, e.g. data.train_batch_size=64.
    """
    overrides = list(overrides or [])
    load_config(config_file, overrides)  # a bad config fails here, before anything is written
    root = Path(run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    acquire_run_lock(root)
    try:
        return _retrain(root, data_dir, iterations, min_improvement, config_file, overrides)
    finally:
        release_run_lock(root)


def _retrain(
    root: Path, data_dir: str, iterations: int, min_improvement: float, config_file, overrides: list[str]
) -> dict:
    champion = read_champion(root)
    new, skipped = take_stock(data_dir, root)
    holder = (
        f"round {champion.round} (step {champion.step}, score {champion.score:.4f})" if champion else BASE
    )
    if not new:
        message = (
            f"no new data in {data_dir} ({skipped} file(s), all taken in before): nothing to train; "
            f"the champion stays {holder}"
        )
        refresh_retrain_catalog(root)
        say(message)
        _markdown(root, "retrain", f"# Retraining: nothing to do\n\n{message}\n")
        return {"trained": False, "reason": message, "champion": champion.checkpoint if champion else None}
    number = next_round(root)
    start = champion.step if champion else 0
    say(f"round {number}: {len(new)} new file(s) in {data_dir}; {iterations} iterations from {holder}")
    cfg = load_config(
        config_file,
        [
            *overrides,
            *round_overrides(root, number, new, champion, iterations, _test_freq(config_file, overrides)),
        ],
    )
    summary = train(cfg)
    incumbent, candidate = round_scores(summary, start + 1, start + iterations)
    decision, reason = decide(candidate, incumbent, min_improvement)
    row = record_round(
        root,
        number,
        new,
        {
            "decision": decision,
            "reason": reason,
            "candidate_score": candidate,
            "champion_score": incumbent,
            "candidate_checkpoint": str(Path(summary["actor_checkpoint"]).parent),
            "incumbent": champion.checkpoint if champion else BASE,
            "first_step": start + 1,
            "last_step": start + iterations,
            "flow_run_id": str(flow_run.id) if flow_run.id else None,
        },
    )
    say(f"round {number}: {decision} — {reason}")
    _markdown(root, "retrain", _decision_markdown(root, row, summary))
    return {
        "trained": True,
        "round": number,
        "decision": decision,
        "reason": reason,
        "run_dir": summary["run_dir"],
    }


def _test_freq(config_file, overrides: list[str]) -> int:
    return load_config(config_file, overrides).trainer.test_freq


def _decision_markdown(root: Path, row: dict, summary: dict) -> str:
    curve = " → ".join(f"{score:.3f}" for _, score in summary["validation"])
    return (
        f"# Retraining round {row['round']}: {row['decision']}\n\n"
        f"{row['reason']}\n\n"
        f"- validation curve of the round: {curve}\n"
        f"- candidate: `{row['candidate_checkpoint']}`\n"
        f"- champion now: `{root / 'champion.json'}`\n"
        f'- every decision: `ppoflow query {root} "SELECT * FROM promotions ORDER BY round"`\n'
    )


def _markdown(root: Path, what: str, text: str) -> None:
    if flow_run.id:
        create_markdown_artifact(text, key=artifact_key(root, what), description=f"ppoflow {what} {root}")
