"""The settings of the model updates, from the config: the actor's and critic's PPO update
(engine/update.py) and their optimizers (engine/optim.py). Part of `run_settings` (settings.py)."""

from __future__ import annotations

from ppoflow.conf import PPOFlowConfig
from ppoflow.conf.schema_common import OptimConfig
from ppoflow.engine.batching import ForwardBatching
from ppoflow.engine.optim import OptimSettings
from ppoflow.engine.update import ActorUpdateSettings, CriticUpdateSettings
from ppoflow.tasks.pipeline.algorithm_settings import policy_loss_spec
from ppoflow.tasks.pipeline.settings import Schedule


def response_length(cfg: PPOFlowConfig) -> int:
    """rollout.response_length, else data.max_response_length: the width verl pads responses to."""
    return cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length


def shares_prompts(cfg: PPOFlowConfig) -> bool:
    """actor.use_prefix_grouper, in one process (sharded ranks run every row whole: conf/effects.py)."""
    return cfg.actor_rollout_ref.actor.use_prefix_grouper and cfg.world_size == 1


def actor_update_settings(cfg: PPOFlowConfig, temperature: float) -> ActorUpdateSettings:
    """`temperature`: the one the rollouts' old log-probs were computed at (1.0 for greedy)."""
    actor, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    return ActorUpdateSettings(
        ppo_epochs=actor.ppo_epochs,
        # A mini-batch is all of its mini·n responses, whatever the ranks (each takes its share of
        # every mini-batch: engine/update.py); verl's global_batch_size is that count too.
        mini_batch_size=actor.ppo_mini_batch_size * n,
        micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
        temperature=temperature,
        policy_loss=policy_loss_spec(cfg),
        loss_agg_mode=actor.loss_agg_mode,
        loss_scale_factor=actor.loss_scale_factor or response_length(cfg),
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        grad_clip=actor.grad_clip,
        shuffle=actor.shuffle,
        gradient_checkpointing=cfg.actor_rollout_ref.model.enable_gradient_checkpointing,
        share_prompts=shares_prompts(cfg),
        max_token_len=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
        remove_padding=packs_actor_passes(cfg),
    )


def packs_actor_passes(cfg: PPOFlowConfig) -> bool:
    """actor_rollout_ref.model.use_remove_padding, unless the prefix grouper shares each prompt's
    forward pass instead (its rows run padded: conf/effects.py names the key as without effect)."""
    return cfg.actor_rollout_ref.model.use_remove_padding and not shares_prompts(cfg)


def critic_update_settings(cfg: PPOFlowConfig) -> CriticUpdateSettings:
    critic, n = cfg.critic, cfg.actor_rollout_ref.rollout.n
    return CriticUpdateSettings(
        ppo_epochs=critic.ppo_epochs,
        mini_batch_size=(critic.ppo_mini_batch_size or cfg.actor_rollout_ref.actor.ppo_mini_batch_size) * n,
        micro_batch_size=critic.ppo_micro_batch_size_per_gpu,
        cliprange_value=critic.cliprange_value,
        loss_agg_mode=critic.loss_agg_mode,
        loss_scale_factor=critic.loss_scale_factor
        or cfg.actor_rollout_ref.actor.loss_scale_factor
        or response_length(cfg),
        grad_clip=critic.grad_clip,
        shuffle=critic.shuffle,
        gradient_checkpointing=critic.model.enable_gradient_checkpointing,
        max_token_len=critic.ppo_max_token_len_per_gpu if critic.use_dynamic_bsz else None,
        remove_padding=critic.model.use_remove_padding,
    )


def log_prob_batching(cfg: PPOFlowConfig, section) -> ForwardBatching:
    """The old (`section` = actor_rollout_ref.rollout) or reference (actor_rollout_ref.ref)
    log-prob pass's micro-batches: its log_prob_micro_batch_size_per_gpu rows, or with
    log_prob_use_dynamic_bsz its log_prob_max_token_len_per_gpu; packed with
    actor_rollout_ref.model.use_remove_padding (verl's one switch for actor, rollout and ref)."""
    return ForwardBatching(
        micro_batch_size=section.log_prob_micro_batch_size_per_gpu,
        max_token_len=section.log_prob_max_token_len_per_gpu if section.log_prob_use_dynamic_bsz else None,
        remove_padding=packs_actor_passes(cfg),
    )


def values_batching(cfg: PPOFlowConfig) -> ForwardBatching:
    """The critic's value pass: critic.forward_micro_batch_size_per_gpu rows, or with
    critic.use_dynamic_bsz its forward_max_token_len_per_gpu; packed with
    critic.model.use_remove_padding."""
    critic = cfg.critic
    return ForwardBatching(
        micro_batch_size=critic.forward_micro_batch_size_per_gpu,
        max_token_len=critic.forward_max_token_len_per_gpu if critic.use_dynamic_bsz else None,
        remove_padding=critic.model.use_remove_padding,
    )


def optim_settings(optim: OptimConfig, total_steps: int) -> OptimSettings:
    """A `*.optim` section as OptimSettings, for a run of `total_steps` training steps."""
    rule = schedule(optim)
    return OptimSettings(
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=tuple(optim.betas),
        warmup_steps=rule.warmup_steps(total_steps),
        total_steps=rule.horizon(total_steps),
        warmup_style=optim.warmup_style,
        min_lr_ratio=optim.min_lr_ratio,
    )


def schedule(optim: OptimConfig) -> Schedule:
    """How an `*.optim` section's LR schedule depends on the run's length: through cosine decay or a
    warmup given as a ratio. Its horizon is the run's length, as verl sets optim.total_training_steps
    (ppoflow: unless the user set it, which fixes the horizon)."""
    fixed = max(optim.total_training_steps, 0)
    return Schedule(optim.lr_warmup_steps, optim.lr_warmup_steps_ratio, optim.spans_steps, fixed)


def schedule_horizon(optim: OptimConfig, total_steps: int) -> int:
    """The training length the LR schedule depends on (`Schedule.horizon`)."""
    return schedule(optim).horizon(total_steps)
