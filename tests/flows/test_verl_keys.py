"""verl keys that ppoflow honours: critic.model.path (a critic from its own model), rollout.seed,
ref.log_prob_micro_batch_size_per_gpu."""

from __future__ import annotations

import pytest
import torch

from ppoflow.conf.schema_common import OptimConfig
from ppoflow.engine.models import load_critic, load_tokenizer
from ppoflow.tasks.pipeline.update_settings import schedule_horizon
from ppoflow.tasks.storage.confined_query import query

from .conftest import train

ONE_STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0"]


@pytest.fixture(scope="module")
def critic_dir(tiny_model_dir, tmp_path_factory):
    """A saved critic of the tiny model's backbone with a value head that is not zero."""
    directory = tmp_path_factory.mktemp("critic-model")
    critic = load_critic(tiny_model_dir)
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.score.weight, std=0.5)
    critic.save_pretrained(directory)
    load_tokenizer(tiny_model_dir).save_pretrained(directory)
    return directory


def test_the_critic_starts_from_critic_model_path_and_rollouts_from_rollout_seed(
    prefect_server, tiny_model_dir, critic_dir, tmp_path
):
    train(tmp_path, *ONE_STEP, f"critic.model.path={critic_dir}", "actor_rollout_ref.rollout.seed=7")
    [(largest,)] = query(
        tmp_path, 'SELECT max(abs(v)) FROM advantages, unnest("values") AS t(v) WHERE iter = 1'
    )[1]
    assert largest > 0.01  # a critic from the actor's directory has a zero head: every first value is 0
    seeds = query(tmp_path, "SELECT DISTINCT seed FROM rollouts")[1]
    assert seeds == [(7 * 1_000_003 + 1,)]  # step 1's seed derives from rollout.seed, not trainer.seed


def test_a_critic_model_with_another_tokenizer_is_refused_before_training(
    prefect_server, tiny_model_dir, critic_dir, tmp_path
):
    other = tmp_path / "other-tokenizer"
    critic = load_critic(critic_dir)
    critic.save_pretrained(other)
    tokenizer = load_tokenizer(critic_dir)
    tokenizer.add_tokens(["§"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match=f"critic.model.path={other}: its tokenizer is not the actor's"):
        train(tmp_path / "run", *ONE_STEP, f"critic.model.path={other}")
    assert (
        not (tmp_path / "run/iter=000001").exists() and not (tmp_path / "run/data").exists()
    )  # before ingest


@pytest.mark.parametrize(
    ("optim", "total", "horizon"),
    [
        ({"warmup_style": "cosine", "total_training_steps": -1}, 40, 40),
        # Set by the user, it fixes the horizon (verl overwrites it with the run's 40): a run
        # extended to 60 steps keeps the learning rate of its first 40.
        ({"warmup_style": "cosine", "total_training_steps": 40}, 60, 40),
        ({"warmup_style": "cosine", "total_training_steps": 100}, 40, 100),
        ({"warmup_style": "constant", "lr_warmup_steps_ratio": 0.1, "total_training_steps": 20}, 40, 20),
        ({"warmup_style": "constant", "total_training_steps": 100}, 40, 0),  # a constant LR has none
    ],
)
def test_the_lr_schedule_spans_the_runs_training_steps_unless_set(optim, total, horizon):
    section = OptimConfig(lr=1e-6, lr_warmup_steps=-1, **optim)
    assert schedule_horizon(section, total) == horizon
