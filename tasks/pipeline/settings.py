"""What each stage is told: typed, frozen settings, built once from the config (`plan.py`) and
passed as they are, down to the engine call that uses them. Field names are verl's (or the engine
name a field's docstring gives), and every default is the config's: nothing here or in the engine
repeats one. A stage's settings are part of its cache key, so a change to one section changes only
the keys of the stages that read it.

The walk of a value, e.g. `actor_rollout_ref.actor.clip_ratio`: the config field
(conf/schema_actor.py) → `ActorUpdateSettings.clip_ratio_low/high` (engine/update.py, built in
update_settings.py) → `RunSettings.actor.update` → the `actor_update` stage (its `settings`
parameter, recorded in `UpdateInputs` for replay) → `engine.update.update_actor` →
`engine.losses.compute_policy_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: a stage's cache key hashes the code it runs (cache_keys.py)
    from ppoflow.engine.lora import LoraSpec
    from ppoflow.engine.names import KLControlType, PFReweightMethod, RolloutEngineName, Truncation
    from ppoflow.engine.optim import OptimSettings
    from ppoflow.engine.ppo import AdvantageSettings
    from ppoflow.engine.rollout import SamplingParams
    from ppoflow.engine.update import ActorUpdateSettings, CriticUpdateSettings
    from ppoflow.engine.vllm_rollout import VLLMOptions


class RewardFunctionError(RuntimeError):
    """The reward function cannot be used, or it failed on rows while reward.on_error=fail."""


@dataclass(frozen=True)
class RewardModelSettings:
    """The reward model that scores each training response (reward_model.*)."""

    path: str = field(metadata={"cache_key": False})
    """reward_model.model.path, resolved (where the files are, not what they are: not in the key)."""
    digest: str
    """Digest of the model directory's files (weights, config, tokenizer): its identity in the key."""
    micro_batch_size: int
    """reward_model.micro_batch_size_per_gpu: rows per forward pass (another size runs kernels of
    another shape, which can round the last bits differently, so it is in the key)."""
    max_length: int
    """reward_model.max_length, else rollout.prompt_length + rollout.response_length: the longest
    input when the responses are re-tokenised for a reward model with its own tokenizer."""


@dataclass(frozen=True)
class DataSettings:
    """Which prompts each step trains on (data.*)."""

    train_batch_size: int
    shuffle: bool
    seed: int
    truncation: Truncation


@dataclass(frozen=True)
class RolloutSettings:
    """Generating one step's responses (actor_rollout_ref.rollout.*)."""

    engine: RolloutEngineName
    """rollout.name: "hf" (transformers) or "vllm"."""
    n: int
    prompt_length: int
    """rollout.prompt_length (data.max_prompt_length unless set)."""
    truncation: Truncation
    """data.truncation."""
    sampling: SamplingParams
    """temperature, top_p, top_k, do_sample; max_new_tokens = rollout.response_length."""
    log_prob_micro_batch_size: int
    """rollout.log_prob_micro_batch_size_per_gpu: rows per old-log-prob forward pass."""
    ref_log_prob_micro_batch_size: int
    """ref.log_prob_micro_batch_size_per_gpu."""
    seed: int
    """rollout.seed, else trainer.seed."""
    generation_batch_size: int | None
    """rollout.micro_batch_size: responses generated together on one device (None with vLLM, which
    schedules its own batches: it is then no part of the cache key)."""
    greedy_baseline: bool
    """algorithm.adv_estimator=remax: also generate one greedy response per prompt, whose reward is
    ReMax's baseline (verl's second, do_sample=False generation)."""
    vllm: VLLMOptions | None = None
    """The vLLM engine's options (rollout.name=vllm; None for hf)."""
    recompute_old_log_probs: bool = True
    """False with algorithm.rollout_correction.bypass_mode: the engine's log-probs are the old ones."""
    share_prompts: bool = field(default=False, metadata={"cache_key": False})
    """actor.use_prefix_grouper (one process only): a prompt's responses share its forward pass in
    the old and reference log-prob passes (the same numbers up to float rounding)."""


@dataclass(frozen=True)
class ValidationSettings:
    """Generating and scoring validation answers (rollout.val_kwargs.*)."""

    engine: RolloutEngineName
    n: int
    """val_kwargs.n answers per prompt."""
    prompt_length: int
    truncation: Truncation
    sampling: SamplingParams
    """val_kwargs' temperature, top_p, top_k, do_sample."""
    generation_batch_size: int | None
    """rollout.micro_batch_size (None with vLLM)."""
    seed: int | None
    """rollout.seed, else trainer.seed, when validation samples (val_kwargs.do_sample and temperature
    > 0); None when it decodes greedily, which draws nothing."""
    log_generations: int = field(metadata={"cache_key": False})
    """trainer.log_val_generations (what is printed, not what is computed: not in the cache key)."""
    vllm: VLLMOptions | None = None
    """The vLLM engine's options (rollout.name=vllm; None for hf)."""


@dataclass(frozen=True)
class PFPPOSettings:
    """algorithm.pf_ppo.*, when algorithm.use_pf_ppo."""

    reweight_method: PFReweightMethod
    weight_pow: float


@dataclass(frozen=True)
class AdvantageStageSettings:
    """Values, token-level rewards and advantages (algorithm.*)."""

    estimator: AdvantageSettings
    values_micro_batch_size: int
    """critic.forward_micro_batch_size_per_gpu."""
    pf_ppo: PFPPOSettings | None
    seed: int
    """trainer.seed (PF-PPO's resampling)."""


@dataclass(frozen=True)
class UpdateSettings:
    """One role's update: the loop, and its optimizer and LR schedule."""

    update: ActorUpdateSettings | CriticUpdateSettings
    optim: OptimSettings
    keep_checkpoints: int | None = field(metadata={"cache_key": False})
    """trainer.max_{actor,critic}_ckpt_to_keep (where results are kept, not what they are: not in
    the cache key)."""
    lora: LoraSpec | None = None
    """The role's LoRA adapters (<model>.lora_rank > 0), or None: every weight trains."""


@dataclass(frozen=True)
class KLControlSettings:
    """algorithm.kl_ctrl.*: β between iterations."""

    type: KLControlType
    target_kl: float
    horizon: int


@dataclass(frozen=True)
class RunSettings:
    data: DataSettings
    rollout: RolloutSettings
    validation: ValidationSettings
    advantages: AdvantageStageSettings
    actor: UpdateSettings
    critic: UpdateSettings | None
    """None when the estimator needs no critic."""
    reward: dict
    """reward.* and custom_reward_function.* (the reward functions' own section)."""
    reward_model: RewardModelSettings | None
    """None without reward_model.enable."""
    kl_control: KLControlSettings
    use_reference: bool
    critic_warmup: int
    test_freq: int
    save_freq: int
    val_before_train: bool
    total_steps: int
    n_devices: int


MAX_UNSAVED_STEPS = 50
"""A checkpoint at least this often, whatever trainer.save_freq says, so that a state to rebuild by
replay is never more than this many updates away from one on disk."""


def checkpoint_due(step: int, total: int, save_freq: int) -> bool:
    """trainer.save_freq (≤ 0: only at the end, as verl's -1), the last step, and every
    MAX_UNSAVED_STEPS steps."""
    return (save_freq > 0 and step % save_freq == 0) or step == total or step % MAX_UNSAVED_STEPS == 0
