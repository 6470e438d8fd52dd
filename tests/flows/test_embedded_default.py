"""`ppoflow train` with no arguments, end to end under Prefect: validation accuracy visibly rises, and
`ppoflow diagnose` finds nothing to warn about."""

from __future__ import annotations

import pytest

from ppoflow.tasks.observe.diagnose import diagnose, load_run, render_text
from ppoflow.tasks.storage.confined_query import query


@pytest.mark.slow
def test_embedded_default_raises_greedy_accuracy_within_20_iterations(
    prefect_server, tiny_model_dir, tmp_path
):
    from ppoflow.flows.train import ppo_train

    summary = ppo_train(None, ["trainer.total_training_steps=20", f"trainer.default_local_dir={tmp_path}"])
    accuracy = dict(
        query(tmp_path, "SELECT iter, avg(components['correctness']) FROM validation GROUP BY iter")[1]
    )
    assert sorted(accuracy) == list(range(21))  # before training, then after every iteration
    base, best = accuracy[0], max(accuracy[i] for i in range(1, 21))
    assert best >= base + 0.15, accuracy
    assert len(summary["val_scores"]) == 21
    run = load_run(tmp_path)
    findings = diagnose(run)
    assert [f for f in findings if f.severity != "info"] == [], "\n".join(
        render_text(tmp_path, run, findings)
    )
