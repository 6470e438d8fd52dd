"""verl keys that a ppoflow run cannot honour: named in one warning at start when they only tune a
backend or a feature this run does not use (here), refused when honouring them would change the
results (unsupported.py).

Every key of the tree either does what verl does with it, or is listed in one of the two: a setting
is never accepted and silently dropped. Only keys set by the user (a config file or an override) are
reported; keys left at their defaults say nothing.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, get_args

from ppoflow.engine.names import AdvEstimator

from .schema_checks import TOKEN_BUDGETS, get_key

if TYPE_CHECKING:
    from .schema import PPOFlowConfig

MODELS = ("actor_rollout_ref.model", "critic.model")
INERT_MODEL_OVERRIDES: dict[str, float | None] = {
    **dict.fromkeys(
        ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.0
    ),
    "classifier_dropout": 0.0,
    "use_cache": None,  # any value: generation keeps its KV cache, training needs none
}
"""override_config entries ppoflow already does (dropout off) or that change no result."""
DYNAMIC_BATCHING = (
    ("actor_rollout_ref.actor", "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu"),
    ("critic", "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu"),
    ("critic", "use_dynamic_bsz", "forward_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.ref", "log_prob_use_dynamic_bsz", "log_prob_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.rollout", "log_prob_use_dynamic_bsz", "log_prob_micro_batch_size_per_gpu"),
    ("reward_model", "use_dynamic_bsz", "micro_batch_size_per_gpu"),
)
"""(section, dynamic-batch switch, the micro-batch size it replaces). Every pass but the reward
model's honours the switch: the updates (`DYNAMIC_UPDATES`, whose micro-batch size the batch-shape
checks still need) and the forward passes (`DYNAMIC_FORWARDS`, which need no size with it)."""
DYNAMIC_UPDATES = ("actor_rollout_ref.actor", "critic")
"""Sections whose use_dynamic_bsz forms the update's micro-batches by ppo_max_token_len_per_gpu."""
DYNAMIC_FORWARDS = tuple(budget for budget in TOKEN_BUDGETS if budget[2] != "ppo_max_token_len_per_gpu")
"""(section, switch, token budget) of the forward-only passes: old and reference log-probs, values."""


@dataclass(frozen=True)
class NoEffect:
    """Keys (fnmatch patterns over dotted keys) with no effect in a run where `applies(cfg)` holds."""

    keys: tuple[str, ...]
    why: str
    applies: Callable[["PPOFlowConfig"], bool] = lambda cfg: True
    except_keys: tuple[str, ...] = ()


def _hf_rollout(cfg: "PPOFlowConfig") -> bool:
    return cfg.actor_rollout_ref.rollout.name == "hf"


NO_EFFECT: tuple[NoEffect, ...] = (
    NoEffect(
        ("reward.weights.*",),
        "custom_reward_function.path scores each response itself (its float, or its dict's 'score'); "
        "reward.weights weighs the built-in rewards' components and rm_score",
        lambda cfg: cfg.custom_reward_function.path is not None,
        except_keys=("reward.weights.rm_score",),
    ),
    NoEffect(
        ("critic.*",),
        "the critic is trained and used only with algorithm.adv_estimator=gae",
        lambda cfg: not cfg.use_critic,
    ),
    NoEffect(
        ("actor_rollout_ref.ref.*",),
        "this run has no reference policy (neither actor.use_kl_loss nor algorithm.use_kl_in_reward)",
        lambda cfg: not cfg.use_reference_policy,
    ),
    NoEffect(
        ("algorithm.kl_ctrl.*", "algorithm.kl_penalty"),
        "the KL penalty in the reward is off (algorithm.use_kl_in_reward=false)",
        lambda cfg: not cfg.algorithm.use_kl_in_reward,
    ),
    NoEffect(
        ("actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type"),
        "the KL loss is off (actor_rollout_ref.actor.use_kl_loss=false)",
        lambda cfg: not cfg.actor_rollout_ref.actor.use_kl_loss,
    ),
    *(
        NoEffect(
            tuple(f"actor_rollout_ref.actor.{key}" for key in keys),
            f"they tune the {mode} policy loss; this run's is another "
            "(actor_rollout_ref.actor.policy_loss.loss_mode)",
            lambda cfg, mode=mode: cfg.actor_rollout_ref.actor.policy_loss.loss_mode != mode,
        )
        for mode, keys in (
            (
                "clip_cov",
                ("policy_loss.clip_cov_ratio", "policy_loss.clip_cov_lb", "policy_loss.clip_cov_ub"),
            ),
            ("kl_cov", ("policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef")),
            ("dro", ("policy_loss.dro_beta",)),
            ("sapo", ("tau_pos", "tau_neg")),
        )
    ),
    *(
        NoEffect(
            (f"{section}.loss_scale_factor",),
            f"it divides only seq-mean-token-sum-norm's loss, and {section}.loss_agg_mode is another",
            lambda cfg, section=section: (
                get_key(cfg, f"{section}.loss_agg_mode") != "seq-mean-token-sum-norm"
            ),
        )
        for section in ("actor_rollout_ref.actor", "critic")
    ),
    NoEffect(
        ("algorithm.norm_adv_by_std_in_grpo",),
        "verl's trainer hands it to grpo and grpo_passk only (grpo_vectorized and gdpo always divide by "
        "the group's std); this run's estimator is another (algorithm.adv_estimator)",
        lambda cfg: cfg.algorithm.adv_estimator not in ("grpo", "grpo_passk"),
    ),
    NoEffect(
        ("algorithm.gdpo_reward_keys", "algorithm.gdpo_reward_weights"),
        "they are gdpo's; this run's estimator is another (algorithm.adv_estimator)",
        lambda cfg: cfg.algorithm.adv_estimator != "gdpo",
    ),
    NoEffect(
        ("algorithm.filter_groups.*", "data.gen_batch_size"),
        "dynamic sampling is off (algorithm.filter_groups.enable=false)",
        lambda cfg: not cfg.algorithm.filter_groups.enable,
        except_keys=("algorithm.filter_groups.enable",),
    ),
    NoEffect(
        ("algorithm.filter_groups.max_inflight_gen_batches",),
        "ppoflow's rollouts stage generates one batch at a time and scores it before the next",
    ),
    NoEffect(
        ("reward_model.overlong_buffer.*",),
        "DAPO's overlong penalty is added only with reward_model.reward_manager=dapo and "
        "reward_model.overlong_buffer.enable=true",
        lambda cfg: cfg.reward_model.reward_manager != "dapo" or not cfg.reward_model.overlong_buffer.enable,
        except_keys=("reward_model.overlong_buffer.enable",),
    ),
    *(
        NoEffect(
            (f"{section}.optim.total_training_steps",),
            "it is the horizon of a cosine decay or of a warm-up given as a ratio, and this "
            f"{section}.optim schedule has neither",
            lambda cfg, section=section: not get_key(cfg, f"{section}.optim").spans_steps,
        )
        for section in ("actor_rollout_ref.actor", "critic")
    ),
    *(
        NoEffect(
            (f"{model}.lora_alpha", f"{model}.target_modules", f"{model}.exclude_modules"),
            f"LoRA is off: {model}.lora_rank=0",
            lambda cfg, model=model: get_key(cfg, f"{model}.lora_rank") == 0,
        )
        for model in MODELS
    ),
    NoEffect(
        (
            "reward_model.model.*",
            "reward_model.strategy",
            "reward_model.micro_batch_size*",
            "reward_model.max_length",
            "reward_model.use_dynamic_bsz",
            "reward_model.forward_max_token_len_per_gpu",
        ),
        "there is no reward model (reward_model.enable=false)",
        lambda cfg: not cfg.reward_model.enable,
    ),
    NoEffect(
        ("reward_model.strategy", "reward_model.model.fsdp_config.*"),
        "the reward model runs unsharded in the trainer's process",
    ),
    NoEffect(
        (
            "algorithm.rollout_correction.rollout_is_threshold",
            "algorithm.rollout_correction.rollout_is_batch_normalize",
        ),
        "importance sampling is off (algorithm.rollout_correction.rollout_is=null)",
        lambda cfg: cfg.algorithm.rollout_correction.rollout_is is None,
    ),
    NoEffect(
        ("algorithm.rollout_correction.rollout_rs_threshold",),
        "rejection sampling is off (algorithm.rollout_correction.rollout_rs=null)",
        lambda cfg: cfg.algorithm.rollout_correction.rollout_rs is None,
    ),
    NoEffect(
        ("algorithm.rollout_correction.loss_type",),
        "the loss type applies in bypass mode only (algorithm.rollout_correction.bypass_mode=false)",
        lambda cfg: not cfg.algorithm.rollout_correction.bypass_mode,
    ),
    NoEffect(
        ("trainer.default_hdfs_dir",),
        "checkpoints are written to the run directory only (copy it where you keep them)",
    ),
    NoEffect(
        ("trainer.project_name",),
        "it names the wandb project, and trainer.logger has no wandb",
        lambda cfg: "wandb" not in cfg.trainer.logger,
    ),
    NoEffect(
        tuple(
            f"actor_rollout_ref.rollout.{key}"
            for key in (
                "gpu_memory_utilization",
                "tensor_model_parallel_size",
                "max_num_batched_tokens",
                "max_num_seqs",
                "enforce_eager",
                "free_cache_engine",
                "enable_chunked_prefill",
                "dtype",
                "load_format",
            )
        ),
        "vLLM settings; this run generates with transformers (rollout.name=hf, in the actor's dtype)",
        _hf_rollout,
    ),
    NoEffect(
        ("actor_rollout_ref.rollout.micro_batch_size",),
        "vLLM schedules its own batches (rollout.max_num_seqs, rollout.max_num_batched_tokens)",
        lambda cfg: cfg.actor_rollout_ref.rollout.name == "vllm",
    ),
    NoEffect(
        ("actor_rollout_ref.rollout.val_kwargs.do_sample",),
        "validation samples only with rollout.val_kwargs.temperature > 0; at 0 (the default) it decodes "
        "greedily, as verl's rollout does, so the val_kwargs.n answers to a prompt are the same",
        lambda cfg: cfg.actor_rollout_ref.rollout.val_kwargs.temperature == 0,
    ),
    NoEffect(
        (
            "actor_rollout_ref.actor.strategy",
            "critic.strategy",
            "*.fsdp_config.*",
            "*.deepspeed_config.*",
        ),
        "world_size is 1 (trainer.nnodes × trainer.n_gpus_per_node): training runs in this process, "
        "unsharded",
        lambda cfg: cfg.world_size == 1,
    ),
    NoEffect(
        ("*.fsdp_config.*",),
        "FSDP2 shards every decoder layer over all ranks, without offloading; the reference policy "
        "is a whole copy on each rank",
        lambda cfg: cfg.world_size > 1,
    ),
    NoEffect(
        ("actor_rollout_ref.hybrid_engine", "actor_rollout_ref.model.use_shm", "trainer.balance_batch"),
        "each rank generates and trains on contiguous shares of the batch; weights stay in memory",
    ),
    NoEffect(
        ("actor_rollout_ref.actor.use_prefix_grouper",),
        "sharded training (world_size > 1) runs every row whole: FSDP2 reshards the weights after "
        "each forward pass, and a shared prompt needs two",
        lambda cfg: cfg.world_size > 1,
    ),
    NoEffect(
        ("actor_rollout_ref.model.use_remove_padding",),
        "actor.use_prefix_grouper shares each prompt's forward pass in the actor's passes instead "
        "(their rows run padded)",
        lambda cfg: cfg.actor_rollout_ref.actor.use_prefix_grouper and cfg.world_size == 1,
    ),
    NoEffect(
        (
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        ),
        "in bypass mode (algorithm.rollout_correction.bypass_mode) the rollout's log-probs are the "
        "old ones: no old-log-prob pass runs",
        lambda cfg: cfg.algorithm.rollout_correction.bypass_mode,
    ),
    NoEffect(
        ("reward_model.model.use_remove_padding",),
        "the reward model's micro-batches run padded (without the columns that are padding in all "
        "of their rows)",
    ),
    NoEffect(
        ("actor_rollout_ref.actor.use_torch_compile",),
        "a speed or memory setting of verl's training backend; results are the same without it",
    ),
    NoEffect(
        ("reward_model.use_dynamic_bsz", "reward_model.forward_max_token_len_per_gpu"),
        "the reward model's forward passes have reward_model.micro_batch_size_per_gpu responses",
    ),
    *(
        NoEffect(
            (f"{section}.{budget}",),
            f"{section}.{switch} is off: its passes have a fixed number of responses",
            lambda cfg, key=f"{section}.{switch}": not get_key(cfg, key),
        )
        for section, switch, budget in DYNAMIC_FORWARDS
    ),
    *(
        NoEffect(
            (f"{section}.ppo_max_token_len_per_gpu",),
            f"{section}.use_dynamic_bsz is off: micro-batches have ppo_micro_batch_size_per_gpu responses",
            lambda cfg, section=section: not get_key(cfg, f"{section}.use_dynamic_bsz"),
        )
        for section in DYNAMIC_UPDATES
    ),
    NoEffect(
        ("*.checkpoint.save_contents", "*.checkpoint.load_contents", "trainer.del_local_ckpt_after_load"),
        "a checkpoint always holds the weights (a Hugging Face directory), and the newest of each role "
        "its optimizer and LR-schedule state (what a resume needs)",
    ),
    NoEffect(
        tuple(f"{model}.override_config.{key}" for model in MODELS for key in INERT_MODEL_OVERRIDES),
        "dropout is always off in ppoflow's models, and the KV cache is used where it helps",
    ),
    NoEffect(
        ("actor_rollout_ref.rollout.multi_turn.*",),
        "multi-turn rollouts are off (actor_rollout_ref.rollout.multi_turn.enable=false)",
        lambda cfg: not cfg.actor_rollout_ref.rollout.multi_turn.enable,
        except_keys=("actor_rollout_ref.rollout.multi_turn.enable",),
    ),
    NoEffect(
        ("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",),
        "ppoflow keeps each turn's generated token ids and never re-tokenizes a conversation: there is "
        "nothing to check",
        lambda cfg: cfg.actor_rollout_ref.rollout.multi_turn.enable,
    ),
    NoEffect(
        ("trainer.resume_from_path",),
        "it is read only with trainer.resume_mode=resume_path, as in verl",
        lambda cfg: cfg.trainer.resume_mode != "resume_path",
    ),
    NoEffect(
        ("trainer.rollout_data_dir", "trainer.validation_data_dir"),
        "every rollout and validation generation is in the rollouts and validation tables (ppoflow query)",
    ),
    NoEffect(
        (
            "trainer.esi_redundant_time",
            "data.dataloader_num_workers",
            "data.val_batch_size",
            "data.return_raw_chat",
            "reward_model.launch_reward_fn_async",
            "actor_rollout_ref.rollout.calculate_log_probs",
        ),
        "ppoflow's stages do this their own way (prompts read from parquet; validation in "
        "micro-batches of rollout.log_prob_micro_batch_size_per_gpu; rewards in their own stage; "
        "rollout log-probs always recorded)",
    ),
)


GROUP_BASELINES = tuple(
    name for name in get_args(AdvEstimator) if name not in ("gae", "reinforce_plus_plus", "remax")
)
"""Estimators whose baseline comes from the prompt's other responses (every one but GAE's critic,
REINFORCE++'s batch whitening and ReMax's greedy response)."""


def greedy_rollout_warning(cfg: "PPOFlowConfig") -> str | None:
    """Training rollouts decoded greedily (temperature 0, top_k 1 or do_sample false) are the same for every
    sample of a prompt and equal to ReMax's greedy baseline: an estimator that compares them with
    each other, or with that baseline, gets advantages of 0 and the actor learns nothing."""
    rollout, estimator = cfg.actor_rollout_ref.rollout, cfg.algorithm.adv_estimator
    if cfg.trainer.val_only or (rollout.do_sample and rollout.temperature > 0 and rollout.top_k != 1):
        return None
    setting = (
        "do_sample=false"
        if not rollout.do_sample
        else "temperature=0"
        if rollout.temperature == 0
        else "top_k=1"
    )
    if estimator == "remax":
        why = "each response is the greedy one ReMax subtracts as its baseline"
    elif estimator in GROUP_BASELINES and rollout.n > 1:
        why = f"the n={rollout.n} responses of a prompt are the same, the baseline {estimator} subtracts"
    else:
        return None
    return (
        f"actor_rollout_ref.rollout.{setting} decodes training rollouts greedily: {why}, so every "
        "advantage is 0 and the actor does not learn; sample "
        "with temperature > 0, top_k other than 1 and do_sample=true"
    )


def without_effect(cfg: "PPOFlowConfig", set_keys: Iterable[str]) -> list[tuple[str, str]]:
    """(key, why) for each key the user set that has no effect in this run, in the order given."""
    found = []
    for key in set_keys:
        rule = next(
            (
                r
                for r in NO_EFFECT
                if any(fnmatchcase(key, p) for p in r.keys) and key not in r.except_keys and r.applies(cfg)
            ),
            None,
        )
        if rule is not None:
            found.append((key, rule.why))
    return found
