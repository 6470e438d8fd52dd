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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from ppoflow.engine.optim import resolve_warmup_steps

if TYPE_CHECKING:  # types only: a stage's cache key hashes the code it runs (cache_keys.py)
    from ppoflow.engine.batching import ForwardBatching
    from ppoflow.engine.lora import LoraSpec
    from ppoflow.engine.names import (
        Gsm8kMethod,
        KLControlType,
        PFReweightMethod,
        RolloutEngineName,
        Truncation,
    )
    from ppoflow.engine.optim import OptimSettings
    from ppoflow.engine.ppo import AdvantageSettings
    from ppoflow.engine.rollout import SamplingParams
    from ppoflow.engine.update import ActorUpdateSettings, CriticUpdateSettings
    from ppoflow.engine.vllm_rollout import VLLMOptions
    from ppoflow.tasks.pipeline.placement import MultiTurnSettings, PlacementPlan


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
class CustomRewardFunction:
    """custom_reward_function.*: the file's absolute path, the function's name and a digest of the
    file's bytes, so that editing the file changes the reward stage's cache key."""

    path: str
    name: str
    digest: str


@dataclass(frozen=True)
class OverlongSettings:
    """DAPO's overlong penalty (reward_model.reward_manager=dapo with overlong_buffer.enable): a
    response of L tokens gets min(0, −(L − (max_response_length − buffer)) / buffer · penalty_factor),
    the reward component `overlong`, added with `weight`."""

    buffer: int
    penalty_factor: float
    max_response_length: int
    """data.max_response_length, as verl's DAPO reward manager reads it."""
    weight: float = 1.0
    """reward.weights.overlong, else 1 (verl adds the penalty to the score)."""


@dataclass(frozen=True)
class RewardSettings:
    """What the rewards and validation stages are told (reward.*, custom_reward_function.*)."""

    weights: Mapping[str, float]
    """reward.weights of the rule components (rm_score, the reward model's weight, aside)."""
    rm_weight: float | None
    """reward.weights.rm_score with a reward model (1.0 unset); None without one."""
    rule_reward: bool
    """False when the reward model's score is the reward alone (a reward model and no rm_score
    weight), as verl's reward managers return its rm_scores instead of the rule reward."""
    reward_fn_key: str
    """data.reward_fn_key: the column that picks a row's reward function."""
    timeout_s: float
    on_error: Literal["fail", "zero"]
    gsm8k_method: Gsm8kMethod
    custom_function: CustomRewardFunction | None
    tool_weight: float = 0.0
    """reward.weights.tool: the weight of a multi-turn response's tool rewards (component `tool`)."""
    overlong: OverlongSettings | None = None
    """DAPO's overlong penalty, with reward_model.reward_manager=dapo and overlong_buffer.enable."""


@dataclass(frozen=True)
class IngestSettings:
    """The data.* keys the prompts stage reads for one split (so that, e.g., a new
    train_batch_size keeps its cache)."""

    prompt_key: str
    reward_fn_key: str
    max_prompt_length: int
    truncation: Truncation
    filter_overlong_prompts: bool
    max_reject_fraction: float
    max_samples: int
    """data.train_max_samples or data.val_max_samples (≤ 0: every row)."""
    tools: tuple[Mapping, ...] = ()
    """The tool schemas chat prompts are rendered with (rollout.multi_turn's tools)."""


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
    log_prob_batching: ForwardBatching
    """The old-log-prob pass's micro-batches: rollout.log_prob_micro_batch_size_per_gpu rows, or
    with rollout.log_prob_use_dynamic_bsz its log_prob_max_token_len_per_gpu; packed with
    model.use_remove_padding."""
    ref_log_prob_batching: ForwardBatching
    """The reference pass's: ref.log_prob_* keys, model.use_remove_padding."""
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
    multi_turn: MultiTurnSettings | None = None
    """rollout.multi_turn with enable=true: each response is a multi-turn trajectory with tool calls."""
    sum_pi_squared: bool = False
    """Keep Σπ² of each token from the old-log-prob pass (rollouts.sum_pi_squared): the optimal token
    baselines read it; actor.calculate_sum_pi_squared asks for it."""
    filter_groups: FilterGroupsSettings | None = None
    """DAPO's dynamic sampling (algorithm.filter_groups.enable)."""


@dataclass(frozen=True)
class FilterGroupsSettings:
    """algorithm.filter_groups with enable=true: the rollouts stage scores each generation batch
    and keeps generating until data.train_batch_size prompts have responses whose `metric` differs."""

    metric: str
    """algorithm.filter_groups.metric."""
    max_num_gen_batches: int
    """The most generation batches a step may take (≤ 0: no limit but the training set)."""
    gen_batch_size: int
    """data.gen_batch_size, else data.train_batch_size: the prompts of each further batch."""
    reward: RewardSettings
    """How every generated response is scored (as the rewards stage scores the kept ones)."""


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
    multi_turn: MultiTurnSettings | None = None
    """rollout.multi_turn with enable=true: validation answers are multi-turn trajectories too."""


@dataclass(frozen=True)
class PFPPOSettings:
    """algorithm.pf_ppo.*, when algorithm.use_pf_ppo."""

    reweight_method: PFReweightMethod
    weight_pow: float


@dataclass(frozen=True)
class AdvantageStageSettings:
    """Values, token-level rewards and advantages (algorithm.*)."""

    estimator: AdvantageSettings
    values_batching: ForwardBatching
    """critic.forward_micro_batch_size_per_gpu rows, or with critic.use_dynamic_bsz its
    forward_max_token_len_per_gpu; packed with critic.model.use_remove_padding."""
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
class MetricsSettings:
    """What the metrics stage compares against (verl's clip ratios of lengths) and divides by."""

    prompt_length: int
    """rollout.prompt_length: prompts this long count as clipped (prompt_length/clip_ratio)."""
    response_length: int
    """rollout.response_length: responses this long count as clipped (response_length/clip_ratio)."""
    n_devices: int
    """trainer.nnodes × trainer.n_gpus_per_node, for verl's per-GPU throughput."""


@dataclass(frozen=True)
class RewardKL:
    """β and the step's KL to the reference in the reward (algorithm.use_kl_in_reward; else None)."""

    coef: float
    current: float | None


@dataclass(frozen=True)
class RunSettings:
    data: DataSettings
    rollout: RolloutSettings
    validation: ValidationSettings
    advantages: AdvantageStageSettings
    actor: UpdateSettings
    critic: UpdateSettings | None
    """None when the estimator needs no critic."""
    reward: RewardSettings
    reward_model: RewardModelSettings | None
    """None without reward_model.enable."""
    kl_control: KLControlSettings
    use_reference: bool
    critic_warmup: int
    test_freq: int
    save_freq: int
    val_before_train: bool
    total_steps: int
    """The run's training steps (known once its data is ingested, `RunPlan.with_total_steps`)."""
    metrics: MetricsSettings


MAX_UNSAVED_STEPS = 50
"""A checkpoint at least this often, whatever trainer.save_freq says, so that a state to rebuild by
replay is never more than this many updates away from one on disk."""


def checkpoint_due(step: int, total: int, save_freq: int) -> bool:
    """trainer.save_freq (≤ 0: only at the end, as verl's -1), the last step, and every
    MAX_UNSAVED_STEPS steps."""
    return (save_freq > 0 and step % save_freq == 0) or step == total or step % MAX_UNSAVED_STEPS == 0


@dataclass(frozen=True)
class Schedule:
    """How one role's LR schedule depends on the run's length (`*.optim`)."""

    lr_warmup_steps: int
    lr_warmup_steps_ratio: float
    spans_steps: bool
    """Cosine decay or a warmup given as a ratio (`OptimConfig.spans_steps`): the horizon is the run's
    length, or `fixed_horizon`; else 0, so that training longer does not invalidate the cached updates
    of a constant schedule (resuming at an epoch boundary with more epochs reuses every finished step)."""
    fixed_horizon: int = 0
    """`optim.total_training_steps` when the user set it (> 0): the schedule spans that many steps
    whatever the run's length, so adding steps to a run keeps every finished step's learning rate
    (and its cached update); steps past it run at the schedule's last value."""

    def horizon(self, total_steps: int) -> int:
        """OptimSettings.total_steps for a run of `total_steps` training steps."""
        if not self.spans_steps:
            return 0
        return self.fixed_horizon or total_steps

    def warmup_steps(self, total_steps: int) -> int:
        """OptimSettings.warmup_steps for a run of `total_steps` training steps (verl's rule)."""
        return resolve_warmup_steps(
            self.lr_warmup_steps, self.lr_warmup_steps_ratio, self.horizon(total_steps)
        )


@dataclass(frozen=True)
class StartPlan:
    """What a run starts from: its models, β, and a checkpoint to resume."""

    actor_path: str
    critic_path: str | None
    """critic.model.path when the estimator needs a critic (the actor's path when it names the same)."""
    seed: int
    use_reference: bool
    kl_coef: float
    val_only: bool
    """trainer.val_only: validate the model as it is, train nothing."""
    resume_mode: Literal["auto", "disable", "resume_path"]
    resume_from_path: str | None
    lora: Mapping[str, LoraSpec | None]
    """role → its LoRA adapters (None: every weight trains)."""


@dataclass(frozen=True)
class DataPlan:
    """Where a run's prompts come from and how they are read."""

    train_files: str | list[str] | None
    """None when only validating."""
    val_files: str | list[str]
    train: IngestSettings
    val: IngestSettings
    train_batch_size: int
    total_epochs: int
    total_training_steps: int | None
    """trainer.total_training_steps, else total_epochs × full batches of the ingested rows."""


@dataclass(frozen=True)
class TrackingSettings:
    """trainer.logger and what a backend records of the run."""

    loggers: tuple[str, ...]
    project_name: str
    experiment_name: str
    log_val_generations: int
    config: Mapping
    """The effective config as JSON (wandb's run config)."""


@dataclass(frozen=True)
class RunPlan:
    """A run, typed: every stage's settings and what the flow needs, built once right after the config
    is loaded (`plan.run_plan`). Only the run's length depends on the data: `with_total_steps` fills
    it (and the LR schedules that depend on it) after ingest."""

    run_dir: str
    config_yaml: str
    """The effective config with each key's origin (config.yaml)."""
    warnings: tuple[str, ...]
    num_threads: int | None
    recompute: bool
    """trainer.resume_mode=disable: every stage runs again."""
    rollout_engine: RolloutEngineName
    placement: PlacementPlan
    start: StartPlan
    data: DataPlan
    settings: RunSettings
    """total_steps 0 (and the schedules' horizons with it) until `with_total_steps`."""
    schedules: Mapping[str, Schedule]
    tracking: TrackingSettings

    def with_total_steps(self, total: int) -> RunPlan:
        """The plan for a run of `total` training steps: its length, and the LR horizon of each role
        whose schedule depends on it (verl sets optim.total_training_steps to the run's length)."""

        def updated(role: str, update: UpdateSettings | None) -> UpdateSettings | None:
            if update is None:
                return None
            rule = self.schedules[role]
            optim = replace(
                update.optim, total_steps=rule.horizon(total), warmup_steps=rule.warmup_steps(total)
            )
            return replace(update, optim=optim)

        settings = replace(
            self.settings,
            total_steps=total,
            actor=updated("actor", self.settings.actor),
            critic=updated("critic", self.settings.critic),
        )
        return replace(self, settings=settings)
