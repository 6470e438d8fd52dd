"""Cross-section rules, applied once when a PPOFlowConfig is built: keys that follow other keys are
filled in (so that each section stands alone as a task's input and cache key), verl's deprecated
global micro-batch sizes become per-GPU sizes, and verl's batch-size arithmetic is checked."""

import difflib
import math
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ppoflow.engine.names import (
    BUILTIN_REWARD_COMPONENTS,
    OVERLONG_REWARD,
    RM_SCORE,
    TOOL_REWARD,
    VLLM_LOAD_FORMATS,
    VLLM_MAX_TEMPERATURE,
)

from .schema_common import ConfigError

if TYPE_CHECKING:
    from .schema import PPOFlowConfig

# How far from the size asked for, and how high, a divisor hint tries numbers (a hint is instant).
_HINT_REACH = 10_000

DERIVED: dict[str, tuple[str, ...]] = {
    "critic.rollout_n": ("actor_rollout_ref.rollout.n",),
    "critic.model.path": ("actor_rollout_ref.model.path",),
    # verl reads the critic's tokenizer from the actor: it must tokenise the actor's responses.
    "critic.model.tokenizer_path": ("actor_rollout_ref.model.tokenizer_path", "actor_rollout_ref.model.path"),
    "critic.ppo_mini_batch_size": ("actor_rollout_ref.actor.ppo_mini_batch_size",),
    "critic.ppo_epochs": ("actor_rollout_ref.actor.ppo_epochs",),
    "critic.forward_micro_batch_size_per_gpu": ("critic.ppo_micro_batch_size_per_gpu",),
    # verl requires it set; following the rollout's log-prob micro-batch lets a run turn on a KL
    # with one key (the size changes no result).
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    ),
    # Like the reference's: turning on a reward model takes one key; the size changes only the last
    # bits of its scores.
    "reward_model.micro_batch_size_per_gpu": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",),
    "actor_rollout_ref.rollout.prompt_length": ("data.max_prompt_length",),
    "actor_rollout_ref.rollout.response_length": ("data.max_response_length",),
}
"""A key left at None → the keys it follows; the first that is not None gives its value."""

ACTOR_MICRO_PAIRS = (
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.use_dynamic_bsz"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz"),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    ),
)
CRITIC_MICRO_PAIRS = (
    ("critic.ppo_micro_batch_size", "critic.use_dynamic_bsz"),
    ("critic.forward_micro_batch_size", "critic.use_dynamic_bsz"),
)
REWARD_MODEL_MICRO_PAIRS = (("reward_model.micro_batch_size", "reward_model.use_dynamic_bsz"),)
"""(deprecated global micro-batch key, dynamic-batch switch); the per-GPU key adds `_per_gpu`."""

WORLD = "world_size={world} (trainer.nnodes={nnodes} × trainer.n_gpus_per_node={gpus})"


def get_key(cfg: BaseModel, key: str) -> Any:
    """The value at a dotted key."""
    value: Any = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value


def _set_key(cfg: BaseModel, key: str, value: Any) -> None:
    # Sections are replaced by updated copies, never mutated: an instance passed in by a caller
    # may be shared with another config.
    head, *rest = key.split(".")
    setattr(cfg, head, _replaced(getattr(cfg, head), rest, value) if rest else value)


def _replaced(model: BaseModel, parts: list[str], value: Any) -> BaseModel:
    head, *rest = parts
    return model.model_copy(update={head: _replaced(getattr(model, head), rest, value) if rest else value})


def _set_explicitly(cfg: BaseModel, key: str) -> bool:
    parent, _, name = key.rpartition(".")
    return name in get_key(cfg, parent).model_fields_set


def followed_source(cfg: BaseModel, key: str) -> str | None:
    """The key a derived `key` holds the value of (its first source that is set, when the values
    agree), or None: e.g. critic.model.tokenizer_path → actor_rollout_ref.model.path."""
    source = next((s for s in DERIVED.get(key, ()) if get_key(cfg, s) is not None), None)
    return source if source is not None and get_key(cfg, source) == get_key(cfg, key) else None


def _fill_derived(cfg: "PPOFlowConfig") -> None:
    for key, sources in DERIVED.items():
        if get_key(cfg, key) is None:
            _set_key(cfg, key, next((v for s in sources if (v := get_key(cfg, s)) is not None), None))


def resolve_and_check(cfg: "PPOFlowConfig") -> None:
    """Fill derived keys, convert deprecated micro-batch sizes, and check the batch arithmetic."""
    _fill_derived(cfg)
    _check_same_n(cfg)
    _check_prompt_budget(cfg)
    _check_token_budgets(cfg)
    _check_reward_weights(cfg)
    _check_rejection_thresholds(cfg)
    _check_resume(cfg)
    pairs = ACTOR_MICRO_PAIRS + (CRITIC_MICRO_PAIRS if cfg.use_critic else ())
    pairs += REWARD_MODEL_MICRO_PAIRS if cfg.reward_model.enable else ()
    for global_key, dynamic_key in pairs:
        _resolve_micro(cfg, global_key, dynamic_key)
    _fill_derived(cfg)  # a per-GPU size converted from a deprecated one is followed too
    _check_vllm(cfg)
    _check_update(cfg, "actor_rollout_ref.actor")
    if cfg.use_critic:
        _check_update(cfg, "critic")


def _check_vllm(cfg: "PPOFlowConfig") -> None:
    """vLLM generates on a GPU, one engine per rank; verl's rule on the scheduler's token budget."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "vllm":
        return
    if cfg.trainer.device != "cuda":
        raise ConfigError(
            "actor_rollout_ref.rollout.name=vllm generates on a GPU: set trainer.device=cuda "
            "(or generate with actor_rollout_ref.rollout.name=hf on this device)",
            keys=("actor_rollout_ref.rollout.name", "trainer.device"),
        )
    if rollout.tensor_model_parallel_size != 1:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size}: "
            "ppoflow runs one vLLM engine per rank, each on its own GPU; set it to 1 and add GPUs as "
            "data-parallel ranks (trainer.n_gpus_per_node)",
            keys=("actor_rollout_ref.rollout.tensor_model_parallel_size",),
        )
    for key, temperature in (
        ("actor_rollout_ref.rollout.temperature", rollout.temperature),
        ("actor_rollout_ref.rollout.val_kwargs.temperature", rollout.val_kwargs.temperature),
    ):
        if temperature > VLLM_MAX_TEMPERATURE:
            raise ConfigError(
                f"{key}={temperature}: vLLM samples with temperatures up to {VLLM_MAX_TEMPERATURE}",
                keys=(key, "actor_rollout_ref.rollout.name"),
            )
    if rollout.load_format not in VLLM_LOAD_FORMATS:
        raise ConfigError(
            f"actor_rollout_ref.rollout.load_format={rollout.load_format!r}: use one of "
            f"{', '.join(VLLM_LOAD_FORMATS)} (the actor's weights are synced in before the first generation "
            "either way)",
            keys=("actor_rollout_ref.rollout.load_format",),
        )
    if rollout.max_num_batched_tokens < rollout.max_num_seqs:
        raise ConfigError(
            f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is below "
            f"max_num_seqs={rollout.max_num_seqs}: vLLM schedules at least one token per sequence in flight; "
            "raise the first or lower the second",
            keys=(
                "actor_rollout_ref.rollout.max_num_batched_tokens",
                "actor_rollout_ref.rollout.max_num_seqs",
            ),
        )
    longest = rollout.prompt_length + rollout.response_length
    if not rollout.enable_chunked_prefill and rollout.max_num_batched_tokens < longest:
        raise ConfigError(
            f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is below "
            f"prompt_length + response_length = {longest}: without chunked prefill a whole prompt is "
            f"scheduled at once; raise it to at least {longest} or set enable_chunked_prefill=true",
            keys=(
                "actor_rollout_ref.rollout.max_num_batched_tokens",
                "actor_rollout_ref.rollout.enable_chunked_prefill",
                "data.max_prompt_length",
                "data.max_response_length",
            ),
        )


def _check_prompt_budget(cfg: "PPOFlowConfig") -> None:
    """Ingest keeps prompts of up to data.max_prompt_length tokens; the rollout must take them."""
    budget, longest = cfg.actor_rollout_ref.rollout.prompt_length, cfg.data.max_prompt_length
    if budget < longest:
        raise ConfigError(
            f"actor_rollout_ref.rollout.prompt_length={budget} is below data.max_prompt_length={longest}: "
            "prompts that ingest keeps would not fit the rollout; remove the first (it follows the "
            "second) or lower the second",
            keys=("actor_rollout_ref.rollout.prompt_length", "data.max_prompt_length"),
        )


TOKEN_BUDGETS = (
    ("actor_rollout_ref.actor", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
    ("critic", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
    ("critic", "use_dynamic_bsz", "forward_max_token_len_per_gpu"),
    ("actor_rollout_ref.rollout", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
    ("actor_rollout_ref.ref", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
)
"""(section, switch, the token budget of its passes) of every pass that can batch by tokens."""


def _check_token_budgets(cfg: "PPOFlowConfig") -> None:
    """With a dynamic-batch switch on, the longest sequence the rollout can make must fit one
    micro-batch of that pass (sections the run does not use are left alone)."""
    rollout = cfg.actor_rollout_ref.rollout
    longest = rollout.prompt_length + rollout.response_length
    for section, switch, budget_key in TOKEN_BUDGETS:
        unused = (
            (section == "critic" and not cfg.use_critic)
            or (section.endswith(".ref") and not cfg.use_reference_policy)
            or (section.endswith(".rollout") and cfg.algorithm.rollout_correction.bypass_mode)
        )
        if unused:
            continue
        budget = get_key(cfg, f"{section}.{budget_key}")
        if get_key(cfg, f"{section}.{switch}") and budget < longest:
            raise ConfigError(
                f"{section}.{budget_key}={budget} is below the longest sequence a rollout can make, "
                f"rollout.prompt_length + rollout.response_length = {longest} tokens: a micro-batch "
                "must hold at least one; raise it",
                keys=(f"{section}.{budget_key}",),
            )


def _check_reward_weights(cfg: "PPOFlowConfig") -> None:
    """Without a custom reward function the components are the built-in rewards': a weight of any
    other name would fail every row of the first rewards stage, after the first rollouts."""
    if cfg.custom_reward_function.path is not None:
        return
    known = (*BUILTIN_REWARD_COMPONENTS, RM_SCORE, TOOL_REWARD, OVERLONG_REWARD)
    unknown = [name for name in cfg.reward.weights if name not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"reward.weights names {', '.join(map(repr, unknown))}{hint}, a component the built-in "
            f"rewards do not return: they return {', '.join(BUILTIN_REWARD_COMPONENTS)} (and {RM_SCORE}, "
            "the reward model's score)",
            keys=("reward.weights",),
        )


def _check_rejection_thresholds(cfg: "PPOFlowConfig") -> None:
    """rollout_rs_threshold has a bound for every rollout_rs criterion, of the criterion's kind."""
    section = cfg.algorithm.rollout_correction
    if section.rollout_rs is None:
        return
    try:
        _ = section.rs_criteria
    except ValueError as error:
        key = "algorithm.rollout_correction.rollout_rs_threshold"
        raise ConfigError(
            f"{key}={section.rollout_rs_threshold!r} for rollout_rs={section.rollout_rs!r}: {error}",
            keys=(key, "algorithm.rollout_correction.rollout_rs"),
        ) from None


def _check_same_n(cfg: "PPOFlowConfig") -> None:
    n, critic_n = cfg.actor_rollout_ref.rollout.n, cfg.critic.rollout_n
    if critic_n != n:
        raise ConfigError(
            f"critic.rollout_n={critic_n} differs from actor_rollout_ref.rollout.n={n}: remove "
            "critic.rollout_n (it always follows actor_rollout_ref.rollout.n)",
            keys=("critic.rollout_n", "actor_rollout_ref.rollout.n"),
        )


def _check_resume(cfg: "PPOFlowConfig") -> None:
    trainer = cfg.trainer
    if trainer.resume_mode == "resume_path" and trainer.resume_from_path is None:
        raise ConfigError(
            "trainer.resume_mode=resume_path needs trainer.resume_from_path: set it to a checkpoint "
            "directory, or use trainer.resume_mode=auto",
            keys=("trainer.resume_mode",),
        )


def _resolve_micro(cfg: "PPOFlowConfig", global_key: str, dynamic_key: str) -> None:
    # verl divides the deprecated global size by the world size inside its workers; doing it here
    # leaves one per-GPU size in the effective config.
    per_gpu_key = global_key + "_per_gpu"
    global_size, per_gpu = get_key(cfg, global_key), get_key(cfg, per_gpu_key)
    keys = (global_key, per_gpu_key)
    if global_size is not None and per_gpu is not None and _set_explicitly(cfg, per_gpu_key):
        raise ConfigError(
            f"{global_key}={global_size} and {per_gpu_key}={per_gpu} are both set: remove {global_key} "
            f"(verl's deprecated global size) and keep {per_gpu_key}",
            keys=keys,
        )
    if global_size is not None:
        world = cfg.world_size
        if global_size % world:
            raise ConfigError(
                f"{global_key}={global_size} cannot be split evenly over {_world(cfg)}: set {per_gpu_key} "
                f"instead, or make {global_key} a multiple of {world}",
                keys=(*keys, "trainer.nnodes", "trainer.n_gpus_per_node"),
            )
        _set_key(cfg, per_gpu_key, global_size // world)
        _set_key(cfg, global_key, None)


def require_micro_batch_sizes(cfg: "PPOFlowConfig") -> None:
    """Every micro-batch size the run uses is set (verl's defaults leave them unset, and so does the
    config model, so that it can be built without them). A validation-only run (trainer.val_only)
    uses none: it only generates."""
    if cfg.trainer.val_only:
        return
    pairs = [p for p in ACTOR_MICRO_PAIRS if cfg.use_reference_policy or ".ref." not in p[0]]
    pairs += CRITIC_MICRO_PAIRS if cfg.use_critic else ()
    for global_key, dynamic_key in pairs:
        per_gpu_key = global_key + "_per_gpu"
        if get_key(cfg, per_gpu_key) is None and not get_key(cfg, dynamic_key):
            raise ConfigError(
                f"{per_gpu_key} is not set (verl leaves it unset too): set it, e.g. {per_gpu_key}=8",
                keys=(global_key, per_gpu_key),
            )


def _check_update(cfg: "PPOFlowConfig", section: str) -> None:
    """verl's rules for one model update: prompts → mini-batches → per-GPU share → micro-batches."""
    train, n, world = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, cfg.world_size
    mini_key, micro_key = f"{section}.ppo_mini_batch_size", f"{section}.ppo_micro_batch_size_per_gpu"
    mini, dynamic = get_key(cfg, mini_key), get_key(cfg, f"{section}.use_dynamic_bsz")
    if train % mini:
        raise ConfigError(
            f"{mini_key}={mini} does not divide data.train_batch_size={train}: choose a mini-batch size "
            f"that divides {train} (e.g. {_near_divisors(train, mini)}) or change data.train_batch_size",
            keys=(mini_key, "data.train_batch_size"),
        )
    responses = mini * n
    shape = f"{mini_key}={mini} × actor_rollout_ref.rollout.n={n}"
    world_keys = ("trainer.nnodes", "trainer.n_gpus_per_node")
    if responses % world:
        raise ConfigError(
            f"the mini-batch of {responses} responses ({shape}) does not split evenly over {_world(cfg)}: "
            f"make {mini_key} × actor_rollout_ref.rollout.n a multiple of {world}",
            keys=(mini_key, "actor_rollout_ref.rollout.n", *world_keys),
        )
    if dynamic:
        return
    micro, per_gpu = get_key(cfg, micro_key), responses // world
    if micro is None:
        return  # require_micro_batch_sizes names it
    share = f"the per-GPU mini-batch of {per_gpu} responses ({shape} / world_size={world})"
    keys = (micro_key, mini_key, "actor_rollout_ref.rollout.n", *world_keys)
    if micro > per_gpu:
        raise ConfigError(
            f"{micro_key}={micro} is larger than {share}: set {micro_key} to at most {per_gpu} "
            f"(e.g. {_near_divisors(per_gpu, micro)}) or raise {mini_key}",
            keys=keys,
        )
    if per_gpu % micro:
        raise ConfigError(
            f"{micro_key}={micro} does not divide {share}: choose a micro-batch size that divides "
            f"{per_gpu} (e.g. {_near_divisors(per_gpu, micro)}) or change {mini_key}",
            keys=keys,
        )


def _world(cfg: "PPOFlowConfig") -> str:
    trainer = cfg.trainer
    return WORLD.format(world=trainer.world_size, nnodes=trainer.nnodes, gpus=trainer.n_gpus_per_node)


def _near_divisors(total: int, wanted: int) -> str:
    """Up to four divisors of total closest to the size the user asked for, in increasing order
    (on a tie the larger one: bigger batches run faster). Tried are the numbers within _HINT_REACH of
    that size and those up to _HINT_REACH with their co-divisors, so that any total answers at once:
    every divisor of a total up to _HINT_REACH², and the nearest four whenever they lie that close."""
    near = range(max(1, wanted - _HINT_REACH), min(total, wanted + _HINT_REACH) + 1)
    divisors = {d for d in near if total % d == 0}
    for d in range(1, min(math.isqrt(total), _HINT_REACH) + 1):
        if total % d == 0:
            divisors |= {d, total // d}
    closest = sorted(sorted(divisors, key=lambda d: (abs(d - wanted), -d))[:4])
    return ", ".join(map(str, closest))
