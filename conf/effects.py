"""verl keys that a ppoflow run cannot honour: refused when honouring them would change the results,
named in one warning at start when they only tune a backend or a feature this run does not use.

Every key of the tree either does what verl does with it, or is listed here: a setting is never
accepted and silently dropped. Only keys set by the user (a config file or an override) are
reported; keys left at their defaults say nothing.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppoflow.engine.names import RM_SCORE

from .schema_checks import followed_source, get_key
from .schema_common import ConfigError

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
"""(section, dynamic-batch switch, the fixed micro-batch size ppoflow uses instead)."""


@dataclass(frozen=True)
class NoEffect:
    """Keys (fnmatch patterns over dotted keys) with no effect in a run where `applies(cfg)` holds."""

    keys: tuple[str, ...]
    why: str
    applies: Callable[["PPOFlowConfig"], bool] = lambda cfg: True


def _hf_rollout(cfg: "PPOFlowConfig") -> bool:
    return cfg.actor_rollout_ref.rollout.name == "hf"


NO_EFFECT: tuple[NoEffect, ...] = (
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
    NoEffect(
        ("*.optim.total_training_steps",),
        "verl sets it to the run's training steps before training (trainer.total_training_steps, or "
        "total_epochs × steps per epoch), and so does ppoflow",
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
            "algorithm.rollout_correction.rollout_rs_threshold",
        ),
        "neither importance sampling nor rejection sampling is on (rollout_is, rollout_rs null)",
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
        ("*.use_remove_padding",),
        "every micro-batch is always run without the columns that are padding in all of its rows "
        "(the same results, up to float rounding)",
    ),
    NoEffect(
        ("actor_rollout_ref.actor.use_torch_compile",),
        "a speed or memory setting of verl's training backend; results are the same without it",
    ),
    NoEffect(
        ("*.use_dynamic_bsz", "*.log_prob_use_dynamic_bsz", "*max_token_len_per_gpu"),
        "micro-batches have a fixed number of responses (*_micro_batch_size_per_gpu); losses are "
        "aggregated over the mini-batch, so the result is the same",
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
    *(
        Unsupported(
            f"algorithm.rollout_correction.{key}",
            lambda value, cfg: value is not None,
            f"{what} is not implemented; ppoflow implements rollout_correction.bypass_mode=true "
            "with loss_type=ppo_clip (set it to null)",
        )
        for key, what in (
            ("rollout_is", "importance-sampling correction (rollout_is)"),
            ("rollout_rs", "rejection sampling (rollout_rs)"),
        )
    ),
    Unsupported(
        "algorithm.rollout_correction.loss_type",
        lambda value, cfg: value != "ppo_clip" and cfg.algorithm.rollout_correction.bypass_mode,
        "bypass mode's REINFORCE loss with importance weights is not implemented: use ppo_clip",
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
    Unsupported(
        "reward_model.reward_manager",
        lambda value, cfg: value not in ("naive", "batch", "prime"),
        "ppoflow scores each response with its reward function, as verl's naive, batch and prime "
        "managers do; other managers (dapo's overlong penalty) change the reward",
    ),
    *(
        Unsupported(
            f"{section}.{switch}",
            lambda value, cfg, size_key=f"{section}.{size}": value and get_key(cfg, size_key) is None,
            f"dynamic batching by token count is not implemented: set {section}.{size}",
        )
        for section, switch, size in DYNAMIC_BATCHING
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


def without_effect(cfg: "PPOFlowConfig", set_keys: Iterable[str]) -> list[tuple[str, str]]:
    """(key, why) for each key the user set that has no effect in this run, in the order given."""
    found = []
    for key in set_keys:
        rule = next(
            (r for r in NO_EFFECT if any(fnmatchcase(key, p) for p in r.keys) and r.applies(cfg)), None
        )
        if rule is not None:
            found.append((key, rule.why))
    return found
