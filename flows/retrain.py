"""The `retrain` flow (scheduled in prefect.yaml): when new data files have arrived, train from the
champion for a few iterations and promote the candidate only if it validates better."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import Field

from ppoflow.conf import load_config
from ppoflow.flows.train import train
from ppoflow.tasks.observe.artifacts import publish_markdown
from ppoflow.tasks.observe.console import say
from ppoflow.tasks.pipeline.plan import ingest_settings, run_plan
from ppoflow.tasks.retraining.rounds import (
    BASE,
    decide,
    decision_markdown,
    find_new_data,
    next_round,
    record_round,
    refresh_retrain_catalog,
    round_overrides,
    round_scores,
    set_aside_unusable,
    start_promotions_table,
    sync_champion_pointer,
)
from ppoflow.tasks.stages.prompts import NotEnoughData, unusable_data_file
from ppoflow.tasks.storage.lock import acquire_run_lock, release_run_lock
from ppoflow.tasks.storage.retrain_tables import PROMOTIONS, ROUNDS
from ppoflow.tasks.storage.run_config import CONFIG

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
    settings = load_config(config_file, overrides)  # a bad config fails here, before anything is written
    root = Path(run_dir).resolve()
    if (root / CONFIG).exists():
        raise ValueError(
            f"{root} is a training run directory; retraining keeps its rounds in a folder of its own"
        )
    root.mkdir(parents=True, exist_ok=True)
    acquire_run_lock(root)
    try:
        start_promotions_table(root)
        champion = sync_champion_pointer(root)
        if champion is not None and not Path(champion.checkpoint).is_dir():
            raise FileNotFoundError(
                f"the champion that {root / PROMOTIONS} names (round {champion.round}, "
                f"{champion.checkpoint}) is not there: a copied retraining directory needs its "
                f"{ROUNDS}/ folder too (or start a new retraining directory)"
            )
        new, skipped = take_stock(data_dir, root)
        data = ingest_settings(settings, "train")
        new, unusable, unreadable = set_aside_unusable(root, new, lambda path: unusable_data_file(path, data))
        for file in unusable:
            say(f"set aside (listed in unusable_files, not tried again): {file['reason']}")
        for why in unreadable:
            say(f"cannot be read now, left for the next run: {why}")
        holder = champion.describe() if champion else BASE
        if not new:
            seen = f"{skipped} file(s), all taken in or set aside before"
            if unusable or unreadable:
                seen = (
                    f"{skipped} file(s) seen before, {len(unusable)} set aside as unusable now, "
                    f"{len(unreadable)} unreadable now"
                )
            return _nothing_to_do(root, f"no new data in {data_dir} ({seen})", holder, champion)
        number = next_round(root)
        start = champion.step if champion else 0
        say(f"round {number}: {len(new)} new file(s) in {data_dir}; {iterations} iterations from {holder}")
        test_freq = settings.trainer.test_freq
        round_cfg = load_config(
            config_file, [*overrides, *round_overrides(root, number, new, champion, iterations, test_freq)]
        )
        try:
            summary = train(run_plan(round_cfg))
        except NotEnoughData as error:  # the files stay new: the next run trains on them and what follows
            return _nothing_to_do(root, f"{error}; waiting for more data", holder, champion)
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
                "train_rows": summary["train_rows"],
                "rejected_rows": summary["train_rejected"],
                "flow_run_id": str(flow_run.id) if flow_run.id else None,
            },
        )
    finally:
        release_run_lock(root)
    say(f"round {number}: {decision} — {reason}")
    publish_markdown(root, "retrain", decision_markdown(root, row, summary))
    return {
        "trained": True,
        "round": number,
        "decision": decision,
        "reason": reason,
        "run_dir": summary["run_dir"],
    }


def _nothing_to_do(root: Path, why: str, holder: str, champion) -> dict:
    message = f"{why}: nothing to train; the champion stays {holder}"
    refresh_retrain_catalog(root)
    say(message)
    publish_markdown(root, "retrain", f"# Retraining: nothing to do\n\n{message}\n")
    return {"trained": False, "reason": message, "champion": champion.checkpoint if champion else None}
