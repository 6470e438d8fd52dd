"""Building a run's settings from its config: every stage's settings (`run_settings`), each trained
role's layout over a worker group (`placement_plan`), and the pieces they are made of. The types are
`settings.py`."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ppoflow.conf import PPOFlowConfig
from ppoflow.conf.model_paths import local_model_path
from ppoflow.conf.tool_config import read_tool_config
from ppoflow.engine.advantages import ADVANTAGE_ESTIMATORS
from ppoflow.engine.data import steps_per_epoch
from ppoflow.engine.lora import LoraSpec
from ppoflow.engine.models import ModelLoadError, damaged_file
from ppoflow.engine.multi_turn import MultiTurnLimits
from ppoflow.engine.names import OVERLONG_REWARD, RM_SCORE, TOOL_REWARD
from ppoflow.engine.ppo import AdvantageSettings
from ppoflow.engine.rollout import SamplingParams
from ppoflow.engine.update import ActorUpdateSettings, CriticUpdateSettings
from ppoflow.engine.vllm_rollout import VLLMOptions
from ppoflow.tasks.pipeline.algorithm_settings import advantage_spec, decoupled_correction
from ppoflow.tasks.pipeline.placement import MultiTurnSettings, PlacementPlan, RoleLayout, ToolSpec
from ppoflow.tasks.pipeline.settings import (
    AdvantageStageSettings,
    CustomRewardFunction,
    DataPlan,
    DataSettings,
    FilterGroupsSettings,
    IngestSettings,
    KLControlSettings,
    MetricsSettings,
    OverlongSettings,
    PFPPOSettings,
    RewardFunctionError,
    RewardModelSettings,
    RewardSettings,
    RolloutSettings,
    RunPlan,
    RunSettings,
    StartPlan,
    TrackingSettings,
    UpdateSettings,
    ValidationSettings,
)
from ppoflow.tasks.pipeline.update_settings import (
    actor_update_settings,
    critic_update_settings,
    log_prob_batching,
    optim_settings,
    schedule,
    shares_prompts,
    values_batching,
)
from ppoflow.tasks.storage.checkpoints import directory_digest


def custom_function(path: str | None, name: str) -> CustomRewardFunction | None:
    """custom_reward_function.*, its file digested (so that editing it changes the reward stage's
    cache key); None when no file is named."""
    if path is None:
        return None
    file = Path(path).resolve()
    if not file.is_file():
        raise RewardFunctionError(f"custom_reward_function.path={path}: no such file")
    return CustomRewardFunction(str(file), name, hashlib.sha256(file.read_bytes()).hexdigest())


def run_settings(cfg: PPOFlowConfig, total_steps: int) -> RunSettings:
    """Every stage's settings for a run of `total_steps` training steps."""
    arr, algorithm = cfg.actor_rollout_ref, cfg.algorithm
    rollout = RolloutSettings(
        engine=arr.rollout.name,
        n=arr.rollout.n,
        prompt_length=arr.rollout.prompt_length,
        truncation=cfg.data.truncation,
        sampling=sampling_params(arr.rollout, arr.rollout.response_length),
        log_prob_batching=log_prob_batching(cfg, arr.rollout),
        ref_log_prob_batching=log_prob_batching(cfg, arr.ref),
        seed=cfg.trainer.seed if arr.rollout.seed is None else arr.rollout.seed,
        generation_batch_size=_generation_batch_size(cfg),
        greedy_baseline=algorithm.adv_estimator == "remax",
        vllm=vllm_options(cfg),
        recompute_old_log_probs=not algorithm.rollout_correction.bypass_mode,
        share_prompts=shares_prompts(cfg),
        multi_turn=multi_turn_settings(cfg),
        sum_pi_squared=arr.actor.calculate_sum_pi_squared
        or "sum_pi_squared" in ADVANTAGE_ESTIMATORS[algorithm.adv_estimator].needs,
        filter_groups=filter_groups_settings(cfg),
    )
    validation_sampling = sampling_params(arr.rollout.val_kwargs, arr.rollout.response_length)
    pf = algorithm.pf_ppo
    return RunSettings(
        data=DataSettings(
            train_batch_size=cfg.data.train_batch_size,
            shuffle=cfg.data.shuffle,
            seed=cfg.data.seed,
            truncation=cfg.data.truncation,
        ),
        rollout=rollout,
        validation=ValidationSettings(
            engine=arr.rollout.name,
            n=arr.rollout.val_kwargs.n,
            prompt_length=arr.rollout.prompt_length,
            truncation=cfg.data.truncation,
            sampling=validation_sampling,
            generation_batch_size=_generation_batch_size(cfg),
            seed=rollout.seed if validation_sampling.do_sample else None,
            log_generations=cfg.trainer.log_val_generations,
            vllm=rollout.vllm,
            multi_turn=rollout.multi_turn,
        ),
        advantages=AdvantageStageSettings(
            estimator=AdvantageSettings(
                estimator=advantage_spec(cfg),
                use_kl_in_reward=algorithm.use_kl_in_reward,
                kl_penalty=algorithm.kl_penalty,
                rollout_correction=decoupled_correction(cfg),
            ),
            values_batching=values_batching(cfg),
            pf_ppo=PFPPOSettings(pf.reweight_method, pf.weight_pow) if algorithm.use_pf_ppo else None,
            seed=cfg.trainer.seed,
        ),
        actor=UpdateSettings(
            update=actor_update_settings(cfg, rollout.sampling.logit_temperature),
            optim=optim_settings(arr.actor.optim, total_steps),
            keep_checkpoints=cfg.trainer.max_actor_ckpt_to_keep,
            lora=lora_spec(arr.model, cfg.trainer.seed),
        ),
        critic=UpdateSettings(
            update=critic_update_settings(cfg),
            optim=optim_settings(cfg.critic.optim, total_steps),
            keep_checkpoints=cfg.trainer.max_critic_ckpt_to_keep,
            lora=lora_spec(cfg.critic.model, cfg.trainer.seed),
        )
        if cfg.use_critic
        else None,
        reward=reward_settings(cfg),
        reward_model=reward_model_settings(cfg),
        kl_control=KLControlSettings(
            type=algorithm.kl_ctrl.type,
            target_kl=algorithm.kl_ctrl.target_kl,
            horizon=algorithm.kl_ctrl.horizon,
        ),
        use_reference=cfg.use_reference_policy,
        critic_warmup=cfg.trainer.critic_warmup,
        test_freq=cfg.trainer.test_freq,
        save_freq=cfg.trainer.save_freq,
        val_before_train=cfg.trainer.val_before_train,
        total_steps=total_steps,
        metrics=MetricsSettings(
            prompt_length=rollout.prompt_length,
            response_length=rollout.sampling.max_new_tokens,
            n_devices=cfg.world_size,
        ),
    )


def multi_turn_settings(cfg: PPOFlowConfig) -> MultiTurnSettings | None:
    """rollout.multi_turn with enable=true (its tool config read and checked again: it is a file that
    may have changed since the config loaded), else None."""
    rollout = cfg.actor_rollout_ref.rollout
    section = rollout.multi_turn
    if not section.enable:
        return None
    entries = read_tool_config(section.tool_config_path) if section.tool_config_path else []
    return MultiTurnSettings(
        limits=MultiTurnLimits(
            response_length=rollout.response_length,
            max_assistant_turns=section.max_assistant_turns,
            max_user_turns=section.max_user_turns,
            max_parallel_calls=section.max_parallel_calls,
            max_tool_response_length=section.max_tool_response_length,
            tool_response_truncate_side=section.tool_response_truncate_side,
        ),
        tools=tuple(
            ToolSpec(e.name, e.class_name, e.schema, e.config, e.module_file, e.attribute, e.source_digest)
            for e in entries
        ),
        tool_timeout_s=section.tool_timeout_s,
    )


def filter_groups_settings(cfg: PPOFlowConfig) -> FilterGroupsSettings | None:
    """algorithm.filter_groups with enable=true (DAPO's dynamic sampling), else None."""
    section = cfg.algorithm.filter_groups
    if not section.enable:
        return None
    return FilterGroupsSettings(
        metric=section.metric,
        max_num_gen_batches=section.max_num_gen_batches,
        gen_batch_size=cfg.data.gen_batch_size or cfg.data.train_batch_size,
        reward=reward_settings(cfg),
    )


def overlong_settings(cfg: PPOFlowConfig) -> OverlongSettings | None:
    """DAPO's overlong penalty (reward_model.reward_manager=dapo, overlong_buffer.enable), else None."""
    buffer = cfg.reward_model.overlong_buffer
    if cfg.reward_model.reward_manager != "dapo" or not buffer.enable:
        return None
    return OverlongSettings(
        buffer=buffer.len,
        penalty_factor=buffer.penalty_factor,
        max_response_length=cfg.data.max_response_length,
        weight=cfg.reward.weights.get(OVERLONG_REWARD, 1.0),
    )


def reward_settings(cfg: PPOFlowConfig) -> RewardSettings:
    """What the rewards and validation stages are told. `weights` are the rule components' (reward.weights
    without rm_score); with a reward model, `rm_weight` is reward.weights.rm_score, and when that is not
    set the score is the reward model's alone (`rule_reward` false), as verl's reward managers return
    its rm_scores instead of the rule reward."""
    weights = dict(cfg.reward.weights)
    rm_weight = weights.pop(RM_SCORE, None)
    tool_weight = weights.pop(TOOL_REWARD, 0.0)
    weights.pop(OVERLONG_REWARD, None)
    enabled = cfg.reward_model.enable
    return RewardSettings(
        weights=weights,
        rm_weight=(1.0 if rm_weight is None else rm_weight) if enabled else None,
        rule_reward=not enabled or rm_weight is not None,
        reward_fn_key=cfg.data.reward_fn_key,
        timeout_s=cfg.reward.timeout_s,
        on_error=cfg.reward.on_error,
        gsm8k_method=cfg.reward.gsm8k_method,
        custom_function=custom_function(cfg.custom_reward_function.path, cfg.custom_reward_function.name),
        tool_weight=tool_weight,
        overlong=overlong_settings(cfg),
    )


def reward_model_settings(cfg: PPOFlowConfig) -> RewardModelSettings | None:
    """The reward model's settings, its files digested once per run (and their headers read);
    None without reward_model.enable."""
    section = cfg.reward_model
    if not section.enable:
        return None
    path = Path(local_model_path(section.model.path, "reward_model.model.path")).resolve()
    if (problem := damaged_file(path)) is not None:  # headers only: a truncated file fails now, not at step 1
        raise ModelLoadError(
            f"reward model at '{path}' (reward_model.model.path) cannot be loaded: {problem}"
        )
    rollout = cfg.actor_rollout_ref.rollout
    return RewardModelSettings(
        path=str(path),
        digest=directory_digest(path),
        micro_batch_size=section.micro_batch_size_per_gpu,
        max_length=section.max_length or rollout.prompt_length + rollout.response_length,
    )


def lora_spec(model, seed: int) -> LoraSpec | None:
    """A model section's LoRA keys (lora_rank, lora_alpha, target_modules, the actor's
    exclude_modules) as a LoraSpec seeded by trainer.seed; None when lora_rank is 0."""
    if model.lora_rank == 0:
        return None

    def names(value: str | list[str] | None) -> str | tuple[str, ...] | None:
        return tuple(value) if isinstance(value, list) else value

    return LoraSpec(
        rank=model.lora_rank,
        alpha=model.lora_alpha,
        target_modules=names(model.target_modules),
        exclude_modules=names(getattr(model, "exclude_modules", None)),
        seed=seed,
    )


def lora_specs(cfg: PPOFlowConfig) -> dict[str, LoraSpec | None]:
    """Each role's LoRA adapters (None: every weight trains)."""
    return {
        "actor": lora_spec(cfg.actor_rollout_ref.model, cfg.trainer.seed),
        "critic": lora_spec(cfg.critic.model, cfg.trainer.seed) if cfg.use_critic else None,
    }


def placement_plan(cfg: PPOFlowConfig) -> PlacementPlan:
    """Where the run's models live (trainer.device, trainer.nnodes × trainer.n_gpus_per_node), and
    with a world size above 1 how the actor (and the critic) are spread over the ranks: verl's
    strategy keys (fsdp runs as FSDP2) and each rank's micro-batches per mini-batch. Nothing in it
    depends on the data, so it is known before the run opens."""
    world, arr = cfg.world_size, cfg.actor_rollout_ref

    def layout(section, loop: ActorUpdateSettings | CriticUpdateSettings) -> RoleLayout:
        return RoleLayout(
            strategy="deepspeed" if section.strategy == "deepspeed" else "fsdp2",
            zero_stage=section.deepspeed_config.zero_stage,
            offload_optimizer=section.deepspeed_config.offload_optimizer,
            micro_batch_size=loop.micro_batch_size,
            micro_batches=loop.mini_batch_size // world // loop.micro_batch_size,
            grad_clip=loop.grad_clip,
        )

    temperature = sampling_params(arr.rollout, arr.rollout.response_length).logit_temperature
    layouts = {"actor": layout(arr.actor, actor_update_settings(cfg, temperature))}
    if cfg.use_critic:
        layouts["critic"] = layout(cfg.critic, critic_update_settings(cfg))
    return PlacementPlan(
        device=cfg.trainer.device,
        world_size=world,
        nnodes=cfg.trainer.nnodes,
        num_threads=cfg.trainer.num_threads,
        layouts=layouts,
    )


def _generation_batch_size(cfg: PPOFlowConfig) -> int | None:
    rollout = cfg.actor_rollout_ref.rollout
    return rollout.micro_batch_size if rollout.name == "hf" else None


def vllm_options(cfg: PPOFlowConfig) -> VLLMOptions | None:
    """actor_rollout_ref.rollout.* as the vLLM engine's options; None when rollout.name is not vllm."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "vllm":
        return None
    return VLLMOptions(
        dtype=rollout.dtype,
        max_model_len=rollout.prompt_length + rollout.response_length,
        load_format=rollout.load_format,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        max_num_batched_tokens=rollout.max_num_batched_tokens,
        max_num_seqs=rollout.max_num_seqs,
        enforce_eager=rollout.enforce_eager,
        free_cache_engine=rollout.free_cache_engine,
        enable_chunked_prefill=rollout.enable_chunked_prefill,
        engine_seed=cfg.trainer.seed if rollout.seed is None else rollout.seed,
    )


def sampling_params(source, response_length: int) -> SamplingParams:
    """verl's rollout settings (rollout.* or rollout.val_kwargs.*) as SamplingParams; temperature 0
    means greedy."""
    return SamplingParams(
        max_new_tokens=response_length,
        temperature=source.temperature if source.temperature > 0 else 1.0,
        top_p=source.top_p,
        top_k=source.top_k,
        do_sample=source.do_sample and source.temperature > 0,
    )


def total_training_steps(data: DataPlan, train_rows: int) -> int:
    """trainer.total_training_steps when set, else total_epochs × full batches per epoch (verl)."""
    if data.total_training_steps:
        return data.total_training_steps
    return data.total_epochs * steps_per_epoch(train_rows, data.train_batch_size)


def run_plan(cfg: PPOFlowConfig) -> RunPlan:
    """The run `cfg` describes, built once right after it is loaded: every stage's settings (for a
    run of 0 steps until `RunPlan.with_total_steps` is given its length), where its models live,
    what it starts from and where its prompts come from."""
    trainer, arr = cfg.trainer, cfg.actor_rollout_ref
    schedules = {"actor": schedule(arr.actor.optim)}
    if cfg.use_critic:
        schedules["critic"] = schedule(cfg.critic.optim)
    return RunPlan(
        run_dir=str(cfg.run_dir),
        config_yaml=cfg.to_yaml(origins=True),
        warnings=tuple(cfg.warnings()),
        num_threads=trainer.num_threads,
        recompute=trainer.resume_mode == "disable",
        rollout_engine=arr.rollout.name,
        placement=placement_plan(cfg),
        start=StartPlan(
            actor_path=arr.model.path,
            critic_path=cfg.critic.model.path if cfg.use_critic else None,
            seed=trainer.seed,
            use_reference=cfg.use_reference_policy,
            kl_coef=cfg.algorithm.kl_ctrl.kl_coef,
            val_only=trainer.val_only,
            resume_mode=trainer.resume_mode,
            resume_from_path=trainer.resume_from_path,
            lora=lora_specs(cfg),
        ),
        data=DataPlan(
            train_files=None if trainer.val_only else cfg.data.train_files,
            val_files=cfg.data.val_files,
            train=ingest_settings(cfg, "train"),
            val=ingest_settings(cfg, "val"),
            train_batch_size=cfg.data.train_batch_size,
            total_epochs=trainer.total_epochs,
            total_training_steps=trainer.total_training_steps,
        ),
        settings=run_settings(cfg, 0),
        schedules=schedules,
        tracking=TrackingSettings(
            loggers=tuple(trainer.logger),
            project_name=trainer.project_name,
            experiment_name=trainer.experiment_name,
            log_val_generations=trainer.log_val_generations,
            config=cfg.model_dump(mode="json"),
        ),
    )


def ingest_settings(cfg: PPOFlowConfig, split: str) -> IngestSettings:
    """The data.* keys ingest reads for `split`, with data.train_max_samples / val_max_samples as
    `max_samples`."""
    data = cfg.data
    return IngestSettings(
        prompt_key=data.prompt_key,
        reward_fn_key=data.reward_fn_key,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        filter_overlong_prompts=data.filter_overlong_prompts,
        max_reject_fraction=data.max_reject_fraction,
        max_samples=data.train_max_samples if split == "train" else data.val_max_samples,
        tools=tool_schemas(cfg),
    )


def tool_schemas(cfg: PPOFlowConfig) -> tuple[dict, ...]:
    """The tool schemas a chat prompt is rendered with (its template's `tools`, as verl renders
    them): multi_turn's tools, none without multi_turn.enable."""
    settings = multi_turn_settings(cfg)
    return () if settings is None else tuple(dict(spec.schema) for spec in settings.tools)
