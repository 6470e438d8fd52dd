"""The `algorithm` section (advantage estimator, KL control) and the reward sections: verl's
`reward_model` and `custom_reward_function`, and ppoflow's composite `reward`."""

from typing import Literal

from pydantic import Field

from ppoflow.engine.names import AdvEstimator, Gsm8kMethod, KLControlType, PFReweightMethod, Strategy

from .schema_common import FsdpConfig, KLType, Section


class KLControlConfig(Section):
    """Coefficient of the KL penalty in the reward (used when algorithm.use_kl_in_reward)."""

    type: KLControlType = "fixed"
    """fixed keeps kl_coef; adaptive steers it towards target_kl (Ziegler et al. 2019)."""
    kl_coef: float = Field(0.001, ge=0)
    """Initial KL coefficient β."""
    horizon: int = Field(10000, gt=0)
    """Adaptive controller horizon in responses."""
    target_kl: float = Field(0.1, gt=0)
    """KL the adaptive controller aims for."""


class PFPPOConfig(Section):
    """Preference-feedback PPO resampling (used when algorithm.use_pf_ppo)."""

    reweight_method: PFReweightMethod = "pow"
    """How rollouts are reweighted by score before resampling."""
    weight_pow: float = Field(2.0, ge=0)
    """Exponent of the pow reweighting |score|^weight_pow; a negative one would give a score of 0 an
    infinite weight, which the resampling cannot draw from."""


class RolloutCorrectionConfig(Section):
    """Training–inference mismatch (verl's algorithm.rollout_correction). ppoflow implements its
    bypass mode with the PPO-clip loss; importance-sampling weights and rejection sampling are refused."""

    bypass_mode: bool = False
    """Take the rollout engine's log-probs as old_log_probs instead of recomputing them with the
    trainer's forward pass (one forward pass less per step; the PPO ratio is then π_θ / π_rollout)."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Loss in bypass mode: ppo_clip (the PPO clipped objective) or reinforce (refused)."""
    rollout_is: str | None = None
    """Importance-sampling weights per token or sequence (refused unless null)."""
    rollout_is_threshold: float = Field(2.0, gt=0)
    """Upper bound of the importance-sampling weights."""
    rollout_is_batch_normalize: bool = False
    """Normalize the importance-sampling weights to mean 1."""
    rollout_rs: str | None = None
    """Rejection sampling by the rollout/trainer ratio (refused unless null)."""
    rollout_rs_threshold: str | float | None = None
    """Threshold of the rejection sampling."""


class AlgorithmConfig(Section):
    """Advantage estimation and the KL penalty in the reward (verl's `algorithm`)."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE λ."""
    adv_estimator: AdvEstimator = "gae"
    """Advantage estimator; gae trains a critic, the others are critic-free."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide group-centred scores by the group's standard deviation (false is Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract β·KL(actor ‖ reference) from the token-level reward."""
    kl_penalty: KLType = "kl"
    """KL estimator of the in-reward penalty."""
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    """KL coefficient control."""
    use_pf_ppo: bool = False
    """Resample rollouts by score before the update (PF-PPO)."""
    pf_ppo: PFPPOConfig = Field(default_factory=PFPPOConfig)
    """PF-PPO settings."""
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    """Training–inference mismatch handling (bypass_mode skips the old-log-prob pass)."""


class RewardModelModelConfig(Section):
    """The reward model's files (verl's reward_model.model)."""

    path: str | None = None
    """Hugging Face directory of a sequence classifier with one label
    (AutoModelForSequenceClassification, num_labels=1) with safetensors weights and a tokenizer;
    required with reward_model.enable."""
    input_tokenizer: str | None = None
    """The tokenizer the responses were generated with (verl: decode them and apply the reward
    model's chat template when its tokenizer differs). ppoflow compares the two tokenizers itself, so
    only the actor's model path (or nothing) is accepted."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory to run."""
    external_lib: str | None = None
    """Python module imported before loading, to register a custom architecture."""
    use_remove_padding: bool = False
    """verl's packing of sequences without padding tokens. ppoflow always leaves out, in every
    micro-batch, the columns that are padding in all of its rows; this setting changes nothing."""
    fsdp_config: FsdpConfig = Field(default_factory=FsdpConfig)
    """FSDP settings (the reward model runs unsharded in the trainer's process)."""


class RewardModelConfig(Section):
    """A learned reward model whose score is a reward component (`rm_score`) beside the rule
    reward (verl's reward_model)."""

    enable: bool = False
    """Score every training response with the reward model (stage reward_model)."""
    strategy: Strategy = "fsdp"
    """How verl shards the reward model; ppoflow runs it in the trainer's process."""
    model: RewardModelModelConfig = Field(default_factory=RewardModelModelConfig)
    """The reward model's files."""
    micro_batch_size: int | None = Field(None, gt=0)
    """Deprecated global micro-batch in responses; use micro_batch_size_per_gpu."""
    micro_batch_size_per_gpu: int | None = Field(None, gt=0)
    """Responses per reward-model forward pass on one GPU; None follows
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu."""
    max_length: int | None = Field(None, gt=0)
    """Longest reward-model input in tokens when the responses are re-tokenised for a reward model
    with its own tokenizer (longer ones are cut on the right); None: the rollout's
    prompt_length + response_length."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token count instead of response count."""
    forward_max_token_len_per_gpu: int = Field(32768, gt=0)
    """Token budget of one forward batch when use_dynamic_bsz is on."""
    reward_manager: str = "naive"
    """How reward functions are applied to a batch (verl's naive manager scores one response at a time)."""
    launch_reward_fn_async: bool = False
    """Score rewards concurrently with the next stage."""


class CustomRewardFunctionConfig(Section):
    """A user reward function `name(data_source, solution_str, ground_truth, extra_info) -> score`."""

    path: str | None = None
    """Python file defining the function; None uses the built-in scorer of each data_source."""
    name: str = "compute_score"
    """Function name inside that file."""


class RewardConfig(Section):
    """ppoflow's composite reward: a weighted sum of named components, each in [0, 1]."""

    weights: dict[str, float] = {"correctness": 0.9, "format": 0.1}
    """Component name → weight in the score (any finite number; a negative one penalises).
    `rm_score` weighs the reward model's score (reward_model.enable) beside the rule components;
    without an `rm_score` weight the score is the reward model's alone, as in verl."""
    timeout_s: float = Field(30.0, gt=0, le=86400)
    """Longest one reward call may take, in seconds of the reward worker's own time (on Linux, time
    spent waiting for a CPU that other processes hold is not counted); at most a day (waits of a few
    weeks overflow the reward worker's timers)."""
    on_error: Literal["fail", "zero"] = "fail"
    """A reward function that raises or times out fails the stage, or scores the response 0."""
    gsm8k_method: Gsm8kMethod = "strict"
    """openai/gsm8k answer extraction (verl): the last '#### <number>', or the last number."""
