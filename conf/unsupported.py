"""verl keys whose value a ppoflow run would have to change the results to honour: a ConfigError at
start that names each one, who set it and what to set instead (the keys that only have no effect in
a run are in effects.py).
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppoflow.engine.names import OVERLONG_REWARD, RM_SCORE, TOOL_REWARD

from .effects import DYNAMIC_BATCHING, DYNAMIC_UPDATES, INERT_MODEL_OVERRIDES, MODELS
from .schema_checks import followed_source, get_key
from .schema_common import ConfigError

if TYPE_CHECKING:
    from .schema import PPOFlowConfig


MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"


@dataclass(frozen=True)
class Unsupported:
    """A key whose value `refused(value, cfg)` would change what is trained: a ConfigError."""

    key: str
    refused: Callable[[Any, "PPOFlowConfig"], bool]
    why: str


def _inert_override(key: str, value: Any) -> bool:
    """An override_config entry that changes nothing in ppoflow's models."""
    if key not in INERT_MODEL_OVERRIDES:
        return False
    wanted = INERT_MODEL_OVERRIDES[key]
    return wanted is None or value == wanted


def _not_the_actor_model(value: Any, cfg: "PPOFlowConfig") -> bool:
    """A tokenizer other than the actor model's own (the critic reads the actor's responses, so its
    tokenizer is the actor's too, as in verl)."""
    model = cfg.actor_rollout_ref.model.path
    return value is not None and Path(value).resolve() != Path(model).resolve()


def _bypass_replaces_the_loss(cfg: "PPOFlowConfig") -> bool:
    """Bypass mode with REINFORCE, importance weights or rejection: the bypass_mode loss runs."""
    correction = cfg.algorithm.rollout_correction
    return correction.bypass_mode and (correction.loss_type == "reinforce" or correction.corrects)


UNSUPPORTED: tuple[Unsupported, ...] = (
    *(
        Unsupported(
            f"{section}.strategy",
            lambda value, cfg, critic=section == "critic": (
                cfg.world_size > 1 and value == "torch" and (cfg.use_critic or not critic)
            ),
            "strategy=torch trains in one process, but world_size (trainer.nnodes × "
            "trainer.n_gpus_per_node) is above 1: set it to fsdp2 (verl's default fsdp runs as "
            "fsdp2) or deepspeed",
        )
        for section in ("actor_rollout_ref.actor", "critic")
    ),
    *(
        Unsupported(
            f"{section}.deepspeed_config.zero_stage",
            lambda value, cfg, section=section: (
                cfg.world_size > 1 and value == 0 and get_key(cfg, f"{section}.strategy") == "deepspeed"
            ),
            "ZeRO stage 0 keeps no gatherable optimizer state and reports no gradient norm: use 1, 2 or 3",
        )
        for section in ("actor_rollout_ref.actor", "critic")
    ),
    Unsupported(
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        lambda value, cfg: value == "bypass_mode" and not cfg.algorithm.rollout_correction.bypass_mode,
        "bypass_mode's loss takes the rollout's log-probs as the old ones: set "
        "algorithm.rollout_correction.bypass_mode=true (with its loss_type, rollout_is and rollout_rs)",
    ),
    Unsupported(
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        lambda value, cfg: (
            value not in ("vanilla", "bypass_mode")
            and cfg.algorithm.rollout_correction.bypass_mode
            and (
                cfg.algorithm.rollout_correction.loss_type == "reinforce"
                or cfg.algorithm.rollout_correction.corrects
            )
        ),
        "bypass mode's REINFORCE loss, importance weights and rejection sampling are the bypass_mode "
        "loss, which replaces this one (as verl's trainer does): use loss_mode=vanilla, or "
        "loss_type=ppo_clip without rollout_is and rollout_rs",
    ),
    Unsupported(
        "actor_rollout_ref.actor.policy_loss.dro_beta",
        lambda value, cfg: value is None and cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "dro",
        "loss_mode=dro needs the weight of its log-ratio penalty: set it to a number > 0",
    ),
    Unsupported(
        "algorithm.gdpo_reward_keys",
        lambda value, cfg: not value and cfg.algorithm.adv_estimator == "gdpo",
        "adv_estimator=gdpo normalises each reward component on its own: list them, e.g. "
        "[correctness,format]",
    ),
    Unsupported(
        "algorithm.gdpo_reward_weights",
        lambda value, cfg: (
            value is not None
            and len(value) != len(cfg.algorithm.gdpo_reward_keys or [])
            and cfg.algorithm.adv_estimator == "gdpo"
        ),
        "give one weight per algorithm.gdpo_reward_keys entry (or none: all 1)",
    ),
    Unsupported(
        "algorithm.adv_estimator",
        lambda value, cfg: (
            value in ("optimal_token_baseline", "tir_optimal_token_baseline")
            and cfg.algorithm.rollout_correction.bypass_mode
        ),
        "the optimal token baselines read Σπ² from the old-log-prob pass, which bypass mode skips: set "
        "algorithm.rollout_correction.bypass_mode=false",
    ),
    Unsupported(
        "actor_rollout_ref.actor.calculate_sum_pi_squared",
        lambda value, cfg: value and cfg.algorithm.rollout_correction.bypass_mode,
        "Σπ² is read off the old-log-prob pass, which bypass mode skips: set "
        "algorithm.rollout_correction.bypass_mode=false, or leave it false",
    ),
    Unsupported(
        "algorithm.adv_estimator",
        lambda value, cfg: value == "grpo_passk" and cfg.actor_rollout_ref.rollout.n < 2,
        "grpo_passk compares the best two responses to a prompt: set actor_rollout_ref.rollout.n ≥ 2",
    ),
    Unsupported(
        "algorithm.filter_groups.enable",
        lambda value, cfg: value and cfg.actor_rollout_ref.rollout.n < 2,
        "a group of one response has no spread to filter on: set actor_rollout_ref.rollout.n ≥ 2",
    ),
    Unsupported(
        "algorithm.filter_groups.enable",
        lambda value, cfg: value and cfg.reward_model.enable,
        "dynamic sampling scores every generated response inside the rollouts stage with the rule "
        "reward, before a reward model's stage runs: train it without reward_model.enable",
    ),
    Unsupported(
        "algorithm.filter_groups.enable",
        lambda value, cfg: value and cfg.algorithm.adv_estimator == "remax",
        "ReMax's greedy baselines are generated for the step's prompts, not for the further batches "
        "dynamic sampling draws: use another estimator",
    ),
    Unsupported(
        "reward_model.overlong_buffer.len",
        lambda value, cfg: (
            cfg.reward_model.overlong_buffer.enable
            and cfg.reward_model.reward_manager == "dapo"
            and not 0 < value <= cfg.data.max_response_length
        ),
        "the overlong buffer must be > 0 and at most data.max_response_length tokens",
    ),
    Unsupported(
        "algorithm.use_pf_ppo",
        lambda value, cfg: value and cfg.world_size > 1,
        "PF-PPO's resampled batch is not split over several ranks yet: train it with world_size 1",
    ),
    *(
        Unsupported(
            f"{model}.lora_rank",
            lambda value, cfg, critic=model == "critic.model": (
                value > 0 and cfg.world_size > 1 and (cfg.use_critic or not critic)
            ),
            "LoRA trains in one process: worker groups (FSDP2, DeepSpeed; world_size = trainer.nnodes × "
            "trainer.n_gpus_per_node above 1) shard full weights only; train LoRA with world_size 1, or "
            "all weights (lora_rank=0)",
        )
        for model in MODELS
    ),
    Unsupported(
        "actor_rollout_ref.model.lora_rank",
        lambda value, cfg: value > 0 and cfg.actor_rollout_ref.rollout.name == "vllm",
        "the vLLM engine is given the actor's full weights by name, not LoRA adapters: generate with "
        "actor_rollout_ref.rollout.name=hf, or train all weights (lora_rank=0)",
    ),
    Unsupported(
        "data.tokenizer",
        _not_the_actor_model,
        "prompts are measured with the actor's tokenizer, as they are generated with it "
        "(leave data.tokenizer unset)",
    ),
    *(
        Unsupported(
            f"{model}.tokenizer_path",
            _not_the_actor_model,
            "ppoflow reads the tokenizer from the actor's model directory: put the tokenizer files "
            "into actor_rollout_ref.model.path (or leave tokenizer_path unset)",
        )
        for model in MODELS
    ),
    *(
        Unsupported(
            f"{model}.override_config",
            lambda value, cfg: any(not _inert_override(k, v) for k, v in value.items()),
            "model config overrides other than turning dropout off (always off in ppoflow) and "
            "use_cache are not supported: edit config.json of a copy of the model",
        )
        for model in MODELS
    ),
    *(
        Unsupported(
            f"{model}.trust_remote_code",
            lambda value, cfg: value,
            "models with their own code are not loaded: use a model transformers knows natively",
        )
        for model in MODELS
    ),
    Unsupported(
        "actor_rollout_ref.model.external_lib",
        lambda value, cfg: value is not None,
        "ppoflow imports no module from a config: use a model transformers knows natively",
    ),
    Unsupported(
        "reward_model.model.path",
        lambda value, cfg: cfg.reward_model.enable and value is None,
        "reward_model.enable=true needs the reward model: set reward_model.model.path to a Hugging Face "
        "directory of a sequence classifier with one label",
    ),
    Unsupported(
        "reward.weights",
        lambda value, cfg: RM_SCORE in value and not cfg.reward_model.enable,
        f"{RM_SCORE} weighs the reward model's score, and there is none: set reward_model.enable=true "
        f"and reward_model.model.path, or remove reward.weights.{RM_SCORE}",
    ),
    Unsupported(
        "reward_model.enable",
        lambda value, cfg: value and cfg.world_size > 1,
        "the reward model runs in the trainer's process, which does not hold models when world_size "
        "(trainer.nnodes × trainer.n_gpus_per_node) is above 1: train with a reward model on one device",
    ),
    Unsupported(
        "reward_model.model.input_tokenizer",
        _not_the_actor_model,
        "the responses are the actor's: ppoflow compares the actor's and the reward model's tokenizers "
        "itself and re-tokenises the responses when they differ (leave input_tokenizer unset)",
    ),
    Unsupported(
        "reward_model.model.trust_remote_code",
        lambda value, cfg: value,
        "models with their own code are not loaded: use a model transformers knows natively",
    ),
    Unsupported(
        "reward_model.model.external_lib",
        lambda value, cfg: value is not None,
        "ppoflow imports no module from a config: use a model transformers knows natively",
    ),
    *(
        Unsupported(
            f"{MULTI_TURN}.{key}",
            lambda value, cfg, default=default: (
                value != default and cfg.actor_rollout_ref.rollout.multi_turn.enable
            ),
            why,
        )
        for key, default, why in (
            (
                "interaction_config_path",
                None,
                "verl's simulated-user interactions are not implemented: set it "
                "to null (tools are: multi_turn.tool_config_path)",
            ),
            (
                "num_repeat_rollouts",
                None,
                "repeated rollouts per interaction are not implemented: set it to "
                "null (rollout.n samples each prompt n times)",
            ),
            (
                "use_inference_chat_template",
                False,
                "ppoflow trains the token ids as generated, never "
                "re-rendered by a chat template: set it to false",
            ),
        )
    ),
    Unsupported(
        f"{MULTI_TURN}.enable",
        lambda value, cfg: value and cfg.actor_rollout_ref.rollout.name == "vllm",
        "multi-turn rollouts run with the transformers engine: set actor_rollout_ref.rollout.name=hf",
    ),
    Unsupported(
        f"{MULTI_TURN}.enable",
        lambda value, cfg: value and cfg.algorithm.adv_estimator == "remax",
        "ReMax's greedy baseline is one turn without tools: use another estimator (grpo, rloo, gae, …)",
    ),
    Unsupported(
        f"{MULTI_TURN}.enable",
        lambda value, cfg: value and cfg.actor_rollout_ref.actor.use_prefix_grouper,
        "a multi-turn response holds tool turns that a shared prompt pass does not cover: set "
        "actor_rollout_ref.actor.use_prefix_grouper=false",
    ),
    Unsupported(
        "reward.weights",
        lambda value, cfg: (
            OVERLONG_REWARD in value
            and (cfg.reward_model.reward_manager != "dapo" or not cfg.reward_model.overlong_buffer.enable)
        ),
        f"{OVERLONG_REWARD} weighs DAPO's overlong penalty, which needs reward_model.reward_manager=dapo "
        f"and reward_model.overlong_buffer.enable=true: set them, or remove reward.weights.{OVERLONG_REWARD}",
    ),
    Unsupported(
        "reward.weights",
        lambda value, cfg: TOOL_REWARD in value and not cfg.actor_rollout_ref.rollout.multi_turn.enable,
        f"{TOOL_REWARD} weighs the rewards of tool calls, and there are none without "
        f"{MULTI_TURN}.enable=true: remove reward.weights.{TOOL_REWARD}",
    ),
    *(
        Unsupported(
            f"{section}.{switch}",
            lambda value, cfg, size_key=f"{section}.{size}": value and get_key(cfg, size_key) is None,
            f"set {section}.{size} too: the batch-shape checks need it (the token budget forms the "
            "update's micro-batches)"
            if section in DYNAMIC_UPDATES
            else f"dynamic batching by token count is not implemented here: set {section}.{size}",
        )
        for section, switch, size in DYNAMIC_BATCHING
        if size != "log_prob_micro_batch_size_per_gpu" and size != "forward_micro_batch_size_per_gpu"
    ),
)


def check_supported(cfg: "PPOFlowConfig", where: Callable[[str], str]) -> None:
    """A ConfigError naming every key whose value would change the run in a way ppoflow cannot do;
    `where(key)` says which layer set it. A derived key (critic.model.tokenizer_path) that holds
    the value of a refused key is not named again: one refusal, at the key the user set."""
    refused = [rule for rule in UNSUPPORTED if rule.refused(get_key(cfg, rule.key), cfg)]
    keys = {rule.key for rule in refused}
    problems = [
        f"{rule.key}={get_key(cfg, rule.key)!r} ({where(rule.key)}): {rule.why}"
        for rule in refused
        if followed_source(cfg, rule.key) not in keys
    ]
    if problems:
        raise ConfigError("\n".join(problems), keys=[rule.key for rule in UNSUPPORTED])
