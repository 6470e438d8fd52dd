"""A start that would make a run another one (another actor model, other training data) is refused
before anything of the run changes; the same run with other settings goes on as before."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ppoflow.tasks.models.host import ModelHost
from ppoflow.tasks.pipeline.run import open_run
from ppoflow.tasks.storage.run_config import AnotherRun, require_same_run

from .conftest import SMALL

REPO = Path(__file__).resolve().parents[2]
GSM8K = [  # the verl quickstart's keys, without trainer.experiment_name
    f"data.train_files={REPO / 'data/gsm8k/train.jsonl'}",
    f"data.val_files={REPO / 'data/gsm8k/test.jsonl'}",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=256",
    "actor_rollout_ref.model.path=builtin:smollm2-135m-instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.optim.lr=1e-5",
    "critic.model.path=builtin:smollm2-135m-instruct",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=console",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=10",
    "trainer.test_freq=10",
    "trainer.total_epochs=15",
]


def _ppoflow(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PPOFLOW_FAULT", "PREFECT_API_URL")}
    return subprocess.run(
        [sys.executable, "-m", "ppoflow", *args],
        env=env | {"PPOFLOW_PROGRESS": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _contents(run_dir: Path) -> dict[str, str]:
    """Every file of the run (links as their targets' names) → its digest."""
    seen = {}
    for path in sorted(run_dir.rglob("*")):
        name = str(path.relative_to(run_dir))
        if path.is_symlink():
            seen[name] = "link to " + os.readlink(path)
        elif path.is_file():
            seen[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return seen


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "demo"
    done = _ppoflow(
        "train",
        *SMALL,
        "trainer.total_training_steps=1",
        "trainer.num_threads=1",
        f"trainer.default_local_dir={run_dir}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_a_start_with_another_model_and_data_leaves_every_file_and_says_what_to_do(finished_run):
    before = _contents(finished_run)
    refused = _ppoflow("train", *GSM8K, f"trainer.default_local_dir={finished_run}")
    assert refused.returncode == 2, refused.stderr[-3000:]
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"ppoflow: {finished_run} holds the steps of another run (")
    assert "actor_rollout_ref.model.path: builtin:tiny-addition → builtin:smollm2-135m-instruct" in line
    assert "data.train_files: builtin:addition → " in line
    assert "give it a run directory of its own (set trainer.default_local_dir to another folder)" in line
    assert line.endswith(f"or remove {finished_run} to start it over")
    assert refused.stdout == ""
    assert _contents(finished_run) == before


@pytest.mark.slow
def test_the_flow_refuses_it_too_and_a_validation_only_start_may_name_other_data(finished_run):
    """A flow run from a deployment opens the run itself: the same refusal, before config.yaml is
    rewritten; data that a validation-only start does not train on is not compared."""
    from ppoflow.conf import load_config

    before = _contents(finished_run)
    other_data = [*SMALL, f"trainer.default_local_dir={finished_run}", GSM8K[0]]
    cfg = load_config(None, other_data)
    with pytest.raises(AnotherRun, match=r"data\.train_files: builtin:addition → .*train\.jsonl"):
        open_run(cfg.run_dir, cfg.to_yaml(origins=True), ModelHost())
    assert _contents(finished_run) == before
    validating = load_config(None, [*other_data, "trainer.val_only=true"])
    run = open_run(validating.run_dir, validating.to_yaml(origins=True), ModelHost())
    try:
        assert any("trainer.val_only: false → true" in change for change in run.config_changes)
    finally:
        from ppoflow.tasks.pipeline.run import close_run

        close_run(run)


def _run_with_steps(run_dir: Path, **keys: object) -> None:
    """A run directory whose last start's config.yaml sets `keys` (dotted), with a step folder."""
    (run_dir / "iter=000001").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(_tree(keys)))


def test_what_counts_as_another_run(tmp_path):
    """A file alone or as a list of one is the same data; a validation-only start compares the model
    only, and one before a training start does not hide the data the run trained on; a retraining
    round takes in new files; the suggested name is never the refused folder's."""
    model = "actor_rollout_ref.model.path"
    run = tmp_path / "tiny-addition"
    _run_with_steps(run, **{model: "builtin:tiny-addition", "data.train_files": "/d/a.jsonl"})
    same = {model: "builtin:tiny-addition", "data.train_files": ["/d/a.jsonl"]}
    require_same_run(run, yaml.safe_dump(_tree(same)))
    with pytest.raises(AnotherRun, match=r"trainer\.experiment_name=tiny-addition-2 trains"):
        require_same_run(run, yaml.safe_dump(_tree({**same, "data.train_files": "/d/b.jsonl"})))
    validating = {**same, "data.train_files": "/d/b.jsonl", "trainer.val_only": True}
    require_same_run(run, yaml.safe_dump(_tree(validating)))
    validated = tmp_path / "validated"
    _run_with_steps(validated, **validating)
    with pytest.raises(AnotherRun):
        require_same_run(validated, yaml.safe_dump(_tree({**same, "data.train_files": "/d/c.jsonl"})))
    round_dir = tmp_path / "retrain/rounds/round=000001"
    _run_with_steps(round_dir, **same)
    require_same_run(
        round_dir, yaml.safe_dump(_tree({**same, "data.train_files": ["/d/a.jsonl", "/d/b.jsonl"]}))
    )


def _tree(keys: dict) -> dict:
    tree: dict = {}
    for key, value in keys.items():
        node = tree
        *sections, last = key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = value
    return tree


@pytest.mark.parametrize("kept", [True, False], ids=["previous kept", "no previous"])
@pytest.mark.parametrize("damage", ["deleted", "not yaml", "a list", "too large"])
def test_steps_without_a_config_of_ppoflows_are_not_taken_for_this_run(tmp_path, damage, kept):
    """Without the config.yaml that says which run the steps are, a start could be another run's:
    refused, with what to do (naming config.previous.yaml only when the run has one), and nothing
    changed."""
    from ppoflow.tasks.storage.run_config import MAX_CONFIG_BYTES

    model = "actor_rollout_ref.model.path"
    run = tmp_path / "demo"
    _run_with_steps(run, **{model: "builtin:tiny-addition"})
    config = run / "config.yaml"
    match damage:
        case "deleted":
            config.unlink()
        case "not yaml":
            config.write_text("trainer: [unclosed\n")
        case "a list":
            config.write_text("- 1\n- 2\n")
        case "too large":
            config.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    if kept:
        (run / "config.previous.yaml").write_text(yaml.safe_dump(_tree({model: "builtin:tiny-addition"})))
    before = _contents(run)
    with pytest.raises(AnotherRun) as info:
        require_same_run(run, yaml.safe_dump(_tree({model: "builtin:smollm2-135m-instruct"})))
    assert str(info.value) == (
        f"{run} holds steps but no config.yaml of ppoflow's that says which run they are; this start could "
        "replace them in place, so nothing was changed: if they are this start's run, put its config.yaml "
        f"back{' (config.previous.yaml holds the one before its last change)' if kept else ''}; else give "
        "this start a run directory of its own (trainer.experiment_name=smollm2-135m-instruct trains in "
        f"runs/smollm2-135m-instruct; or set trainer.default_local_dir), or remove {run} to start it over"
    )
    assert _contents(run) == before


def test_a_run_whose_tables_were_deleted_still_has_its_models(tmp_path):
    """checkpoints/iter=k without iter=k: a start of another model would save over those checkpoints."""
    model = "actor_rollout_ref.model.path"
    run = tmp_path / "demo"
    _run_with_steps(run, **{model: "builtin:tiny-addition"})
    (run / "iter=000001").rmdir()
    (run / "checkpoints/iter=000001/actor").mkdir(parents=True)
    with pytest.raises(AnotherRun, match="holds the steps of another run"):
        require_same_run(run, yaml.safe_dump(_tree({model: "builtin:smollm2-135m-instruct"})))
    require_same_run(run, yaml.safe_dump(_tree({model: "builtin:tiny-addition"})))


def test_training_data_edited_in_place_is_another_run(tmp_path):
    """The content digest ingest records is compared at start: training data edited in place (the same
    path) was taken in again silently and every step recomputed and rewritten in place. A
    validation-only start trains on no data: not compared. The data put back is the run again."""
    from ppoflow.tasks.storage.data_sources import content_digest, record_sources

    data = tmp_path / "sums.jsonl"
    data.write_text('{"prompt": "1 + 1 = "}\n')
    keys = {"actor_rollout_ref.model.path": "builtin:tiny-addition", "data.train_files": str(data)}
    run = tmp_path / "demo"
    _run_with_steps(run, **keys)
    record_sources(run, "train", str(data), content_digest(str(data)))
    start = yaml.safe_dump(_tree(keys))
    require_same_run(run, start)
    data.write_text('{"prompt": "1 + 2 = "}\n')
    before = _contents(run)
    with pytest.raises(AnotherRun) as info:
        require_same_run(run, start)
    assert str(info.value).startswith(
        f"{run} holds the steps of another run (data.train_files: {data}, edited since the run's last "
        "start (sha256:"
    )
    assert "nothing was changed: put back the data it trained on, or give it a run directory" in str(
        info.value
    )
    assert _contents(run) == before
    require_same_run(run, yaml.safe_dump(_tree({**keys, "trainer.val_only": True})))
    data.write_text('{"prompt": "1 + 1 = "}\n')
    require_same_run(run, start)
