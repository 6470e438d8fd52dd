"""A run's config.yaml: rewritten by every start, the one before kept and the changed keys named
when they differ."""

from __future__ import annotations

import os

from ppoflow.conf import load_config
from ppoflow.tasks.models.host import ModelHost
from ppoflow.tasks.pipeline.run import close_run, open_run
from ppoflow.tasks.storage.run_config import PREVIOUS_CONFIG, changes_line, record_config


def _yaml(*overrides: str) -> str:
    return load_config(None, list(overrides), check_paths=False).to_yaml(origins=True)


def test_a_changed_config_names_its_changed_keys_and_keeps_the_one_before(tmp_path):
    first = _yaml("trainer.total_training_steps=5")
    assert record_config(tmp_path, first) == []  # a new run: nothing to compare with
    assert record_config(tmp_path, first) == [] and not (tmp_path / PREVIOUS_CONFIG).exists()
    second = _yaml("trainer.total_training_steps=5", "actor_rollout_ref.actor.optim.lr=2e-6")
    changes = record_config(tmp_path, second)
    assert changes == ["actor_rollout_ref.actor.optim.lr: 0.0003 → 2.0e-06"]
    assert (tmp_path / PREVIOUS_CONFIG).read_text() == first
    assert (tmp_path / "config.yaml").read_text() == second
    third = _yaml("trainer.total_training_steps=9", "trainer.project_name=x", "data.train_files=[a.jsonl]")
    changes = record_config(tmp_path, third)
    assert changes[:1] == ["actor_rollout_ref.actor.optim.lr: 2.0e-06 → 0.0003"]
    assert "trainer.total_training_steps: 5 → 9" in changes and len(changes) == 4
    line = changes_line([f"k{i}: 0 → 1" for i in range(8)])
    assert (
        line.startswith("the config differs from this run's last start (k0: 0 → 1; ")
        and "; and 2 more): a stage whose settings changed is computed again" in line
    )
    validating = changes_line(["trainer.val_only: false → true"], validation_only=True)
    assert (
        "(trainer.val_only: false → true): a validation-only start trains nothing: only the validation "
        "of its step runs, computed again if its settings changed" in validating
    )
    assert "computed again, with" not in validating


def test_what_is_not_a_config_ppoflow_wrote_is_replaced_without_comparing(tmp_path):
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(20)
    )
    planted_files = (
        laughs,
        "- a list\n",
        "not: [yaml\n",
        b"\xff\xfe".decode("latin-1"),
        "when: 2024-13-45\n",
    )
    for planted in (*planted_files, f"n: {'9' * 5000}\n"):
        (tmp_path / "config.yaml").write_text(planted)
        assert record_config(tmp_path, _yaml()) == []
    (tmp_path / "config.yaml").unlink()
    os.mkfifo(tmp_path / "config.yaml")  # read, it would block
    assert record_config(tmp_path, _yaml()) == []
    (tmp_path / "config.yaml").unlink()
    (tmp_path / "config.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    (tmp_path / "elsewhere.yaml").write_text(_yaml("trainer.seed=9"))
    assert record_config(tmp_path, _yaml()) == []  # a link is not read: replaced by the file
    assert not (tmp_path / "config.yaml").is_symlink()
    assert (tmp_path / "elsewhere.yaml").read_text() == _yaml("trainer.seed=9")


def test_a_key_that_follows_a_changed_one_is_not_named_again(tmp_path):
    record_config(tmp_path, _yaml())
    changes = record_config(tmp_path, _yaml("actor_rollout_ref.rollout.n=4"))
    assert changes == ["actor_rollout_ref.rollout.n: 1 → 4"]  # not critic.rollout_n, which follows it
    epochs = "actor_rollout_ref.actor.ppo_epochs"
    changes = record_config(
        tmp_path, _yaml("actor_rollout_ref.rollout.n=4", f"{epochs}=2", "critic.ppo_epochs=3")
    )
    assert changes == [f"{epochs}: 4 → 2", "critic.ppo_epochs: 1 → 3"]  # set, not followed: named


def test_open_run_hands_the_changes_to_the_flow(tmp_path):
    close_run(open_run(tmp_path, _yaml("trainer.seed=1"), ModelHost()))
    run = open_run(tmp_path, _yaml("trainer.seed=2"), ModelHost())
    try:
        assert run.config_changes == ("trainer.seed: 1 → 2",)
    finally:
        close_run(run)


def test_a_run_copied_elsewhere_is_not_told_its_folder_changed(tmp_path):
    # No stage reads trainer.default_local_dir: naming it would say the copy trains another config.
    record_config(tmp_path, _yaml(f"trainer.default_local_dir={tmp_path}/a"))
    assert record_config(tmp_path, _yaml(f"trainer.default_local_dir={tmp_path}/b")) == []
    assert not (tmp_path / PREVIOUS_CONFIG).exists()
    moved = record_config(tmp_path, _yaml(f"trainer.default_local_dir={tmp_path}/c", "trainer.seed=2"))
    assert moved == ["trainer.seed: 1 → 2"]
