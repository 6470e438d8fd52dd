"""The run plan is built once from the config, before the run opens; only the run's length is filled
after ingest, and the settings it then gives every stage are those built for that length directly."""

from __future__ import annotations

import pytest

from ppoflow.conf import load_config
from ppoflow.tasks.pipeline.plan import run_plan, run_settings

CONFIGS = {
    "embedded default": [],
    "cosine, warmup ratio": [
        "actor_rollout_ref.actor.optim.warmup_style=cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
        "critic.optim.lr_warmup_steps=3",
    ],
    "cosine over a set horizon": [
        "actor_rollout_ref.actor.optim.warmup_style=cosine",
        "actor_rollout_ref.actor.optim.total_training_steps=30",
        "critic.optim.lr_warmup_steps_ratio=0.2",
    ],
    "grpo, no critic, LoRA": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
    ],
    "two ranks, FSDP2 and DeepSpeed": [
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "critic.strategy=deepspeed",
        "critic.deepspeed_config.zero_stage=2",
    ],
}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("total", [1, 40, 117])
def test_filling_the_length_gives_the_settings_built_for_it(overrides, total):
    cfg = load_config(None, overrides, check_paths=False)
    assert run_plan(cfg).with_total_steps(total).settings == run_settings(cfg, total)


def test_the_plan_holds_what_the_flow_reads(tmp_path):
    cfg = load_config(
        None, [*CONFIGS["two ranks, FSDP2 and DeepSpeed"], f"trainer.default_local_dir={tmp_path}"]
    )
    plan = run_plan(cfg)
    assert plan.run_dir == str(tmp_path) and plan.config_yaml == cfg.to_yaml(origins=True)
    assert (plan.placement.world_size, plan.placement.device) == (2, "cpu")
    actor, critic = plan.placement.layouts["actor"], plan.placement.layouts["critic"]
    assert (actor.strategy, critic.strategy, critic.zero_stage) == ("fsdp2", "deepspeed", 2)
    assert (
        actor.micro_batches
        == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        * cfg.actor_rollout_ref.rollout.n
        // 2
        // actor.micro_batch_size
    )
    assert plan.start.critic_path == plan.start.actor_path == cfg.actor_rollout_ref.model.path
    assert plan.data.train.max_samples == cfg.data.train_max_samples
    assert plan.settings.total_steps == 0 and plan.with_total_steps(7).settings.total_steps == 7
