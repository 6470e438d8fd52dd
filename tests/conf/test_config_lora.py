"""verl's LoRA keys (actor_rollout_ref.model.lora_rank, lora_alpha, target_modules, exclude_modules and
the critic's): their defaults, the settings they become, the runs that refuse them, and the cache keys
they enter (those of the updates, whose states then differ; no other stage's settings)."""

import pytest

from ppoflow.conf import ConfigError, load_config
from ppoflow.engine.lora import LoraSpec
from ppoflow.tasks.pipeline.cache_keys import digest_of
from ppoflow.tasks.pipeline.plan import lora_specs, run_settings

ACTOR = "actor_rollout_ref.model"


def test_the_defaults_are_verls_and_leave_lora_off():
    cfg = load_config(None, check_paths=False)
    for model in (cfg.actor_rollout_ref.model, cfg.critic.model):
        assert (model.lora_rank, model.lora_alpha, model.target_modules) == (0, 16, "all-linear")
    assert cfg.actor_rollout_ref.model.exclude_modules is None
    assert lora_specs(cfg) == {"actor": None, "critic": None}
    settings = run_settings(cfg, total_steps=2)
    assert settings.actor.lora is None and settings.critic.lora is None


def test_the_keys_become_each_roles_lora_spec_seeded_by_the_trainer_seed():
    cfg = load_config(
        None,
        [
            f"{ACTOR}.lora_rank=8",
            f"{ACTOR}.lora_alpha=32",
            f"{ACTOR}.target_modules=[q_proj,v_proj]",
            f"{ACTOR}.exclude_modules=.*layers\\.0\\..*",
            "critic.model.lora_rank=4",
            "trainer.seed=5",
        ],
        check_paths=False,
    )
    assert lora_specs(cfg) == {
        "actor": LoraSpec(8, 32, ("q_proj", "v_proj"), r".*layers\.0\..*", seed=5),
        "critic": LoraSpec(4, 16, "all-linear", None, seed=5),
    }
    settings = run_settings(cfg, total_steps=2)
    assert settings.actor.lora == lora_specs(cfg)["actor"]
    assert settings.critic.lora == lora_specs(cfg)["critic"]


def test_a_critic_lora_rank_in_a_run_without_a_critic_is_named_as_without_effect():
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "critic.model.lora_rank=8"], check_paths=False)
    assert lora_specs(cfg)["critic"] is None
    assert "critic.model.lora_rank" in dict(cfg.settings_without_effect())


def test_lora_alpha_and_target_modules_without_a_rank_are_named_as_without_effect():
    cfg = load_config(None, [f"{ACTOR}.lora_alpha=32", f"{ACTOR}.target_modules=[q_proj]"], check_paths=False)
    assert dict(cfg.settings_without_effect()) == {
        f"{ACTOR}.lora_alpha": f"LoRA is off: {ACTOR}.lora_rank=0",
        f"{ACTOR}.target_modules": f"LoRA is off: {ACTOR}.lora_rank=0",
    }


@pytest.mark.parametrize(
    ("overrides", "key", "why"),
    [
        (
            [f"{ACTOR}.lora_rank=8", "trainer.n_gpus_per_node=2"],
            f"{ACTOR}.lora_rank",
            "LoRA trains in one process",
        ),
        (
            ["critic.model.lora_rank=8", "trainer.n_gpus_per_node=2"],
            "critic.model.lora_rank",
            "worker groups",
        ),
        (
            [f"{ACTOR}.lora_rank=8", "actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda"],
            f"{ACTOR}.lora_rank",
            "the vLLM engine is given the actor's full weights",
        ),
        ([f"{ACTOR}.lora_rank=-1"], f"{ACTOR}.lora_rank", "greater than or equal to 0"),
        ([f"{ACTOR}.lora_rank=8", f"{ACTOR}.lora_alpha=0"], f"{ACTOR}.lora_alpha", "greater than 0"),
    ],
)
def test_lora_where_ppoflow_cannot_train_it_is_refused_naming_the_key(overrides, key, why):
    with pytest.raises(ConfigError, match=why) as raised:
        load_config(None, overrides, check_paths=False)
    assert key in str(raised.value)


def test_a_critic_lora_rank_with_several_devices_is_refused_only_when_the_critic_trains():
    grpo = ["algorithm.adv_estimator=grpo", "critic.model.lora_rank=8", "trainer.n_gpus_per_node=2"]
    assert load_config(None, grpo, check_paths=False).critic.model.lora_rank == 8


def test_the_lora_keys_change_the_update_settings_and_nothing_else():
    """A stage's cache key digests the settings it is given: LoRA keys reach the update stages (and,
    through the states they produce, every later stage), never the settings of another stage."""
    plain = run_settings(load_config(None, check_paths=False), total_steps=2)
    lora = run_settings(
        load_config(None, [f"{ACTOR}.lora_rank=8", "critic.model.lora_rank=4"], check_paths=False), 2
    )
    alpha = run_settings(
        load_config(
            None,
            [f"{ACTOR}.lora_rank=8", f"{ACTOR}.lora_alpha=8", "critic.model.lora_rank=4"],
            check_paths=False,
        ),
        2,
    )
    for stage in ("actor", "critic"):
        keys = {digest_of(getattr(s, stage)) for s in (plain, lora, alpha)}
        assert len(keys) == (3 if stage == "actor" else 2)
    for stage in ("data", "rollout", "validation", "advantages", "reward", "kl_control"):
        assert len({digest_of(getattr(s, stage)) for s in (plain, lora, alpha)}) == 1, stage
