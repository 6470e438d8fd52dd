"""The `algorithm` section (advantage estimator, KL control) and the reward sections: verl's
`reward_model` and `custom_reward_function`, and ppoflow's composite `reward`."""

from typing import Literal

from pydantic import Field, field_validator

from ppoflow.engine.names import (
    AdvEstimator,
    BypassLossType,
    Gsm8kMethod,
    KLControlType,
    PFReweightMethod,
    RolloutISLevel,
    Strategy,
)

from .rollout_correction_keys import parse_is_threshold, parse_rs_thresholds, rs_options
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
    """Training–inference mismatch (verl's algorithm.rollout_correction): importance weights and
    rejection sampling between the rollout engine's log-probs and the trainer's. Decoupled mode
    (bypass_mode=false) takes them once per step against the recomputed old log-probs, in the
    advantages stage (their columns are in the advantages table); bypass mode takes the rollout's
    log-probs as the old ones and, with loss_type=reinforce or importance weights or rejection set,
    weighs and rejects inside the loss (policy_loss.loss_mode bypass_mode)."""

    bypass_mode: bool = False
    """Take the rollout engine's log-probs as old_log_probs instead of recomputing them with the
    trainer's forward pass (one forward pass less per step; the PPO ratio is then π_θ / π_rollout)."""
    loss_type: BypassLossType = "ppo_clip"
    """Loss in bypass mode: ppo_clip (PPO's clipped objective, whose ratio already is π_θ / π_rollout)
    or reinforce (−A·log π_θ weighted by the importance weights)."""
    rollout_is: RolloutISLevel | None = None
    """Importance weights per token (token) or per sequence (sequence: the product of its tokens'
    ratios); null: none."""
    rollout_is_threshold: float | str = 2.0
    """A number: weights above it are truncated to it (TIS); 'lower_upper' (e.g. '0.5_5.0'): weights
    outside the range are set to 0 (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their batch mean (over tokens, or sequences for sequence weights)."""
    rollout_rs: str | None = None
    """Rejection sampling: one or several comma-separated criteria among token_k1, token_k2, token_k3,
    seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3 (k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ
    per token; a token is kept when every criterion keeps it); null: none."""
    rollout_rs_threshold: str | float | None = None
    """The criteria's bounds, one for all or one per criterion (comma-separated): a *_k1 criterion
    takes 'lower_upper' ratio bounds (a single number u means 1/u to u), the others an upper bound."""

    @field_validator("rollout_is_threshold")
    @classmethod
    def _is_threshold(cls, value: float | str) -> float | str:
        parse_is_threshold(value)
        return value

    @field_validator("rollout_rs")
    @classmethod
    def _rs_options(cls, value: str | None) -> str | None:
        if value is not None:
            rs_options(value)
        return value

    @property
    def is_bounds(self) -> tuple[float, float | None]:
        """(upper, lower or None) of rollout_is_threshold."""
        return parse_is_threshold(self.rollout_is_threshold)

    @property
    def rs_criteria(self) -> tuple[tuple[str, float, float | None], ...]:
        """(option, upper, lower or None) of each rollout_rs criterion, in order, duplicates dropped."""
        if self.rollout_rs is None:
            return ()
        return parse_rs_thresholds(rs_options(self.rollout_rs), self.rollout_rs_threshold)

    @property
    def corrects(self) -> bool:
        """Importance weights or rejection sampling are on."""
        return self.rollout_is is not None or self.rollout_rs is not None


class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): a step's rollouts stage generates
    further batches of prompts until data.train_batch_size prompts have responses whose `metric`
    differs (a group whose responses all score alike gives no signal); the groups dropped are rows
    of the filter_groups table."""

    enable: bool = False
    """Drop groups whose responses all have the same `metric`, and generate more."""
    metric: str = "reward"
    """What must differ within a group: reward, score, seq_reward or seq_final_reward (the response's
    score), acc (its correctness component, else its score), or the name of a reward component."""
    max_num_gen_batches: int = 0
    """The most generation batches a step may take; 0 or less: no limit but the training set."""
    max_inflight_gen_batches: int = Field(1, gt=0)
    """verl's asynchronous batches in flight; ppoflow generates one batch at a time."""


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
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling."""
    gdpo_reward_keys: list[str] | None = None
    """gdpo: the reward components normalised one by one within their group (e.g. [correctness,
    format]); required with adv_estimator=gdpo."""
    gdpo_reward_weights: list[float] | None = None
    """gdpo: one weight per gdpo_reward_keys entry; null: all 1."""


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


class OverlongBufferConfig(Section):
    """DAPO's overlong reward shaping (verl's reward_model.overlong_buffer, read by reward_manager=dapo):
    a response of L tokens gets min(0, −(L − (max_response_length − len)) / len · penalty_factor)."""

    enable: bool = False
    """Add the penalty (the reward component `overlong`, weight 1 unless reward.weights.overlong)."""
    len: int = Field(0, ge=0)
    """The buffer: the last `len` tokens before data.max_response_length, over which the penalty grows
    from 0 to −penalty_factor; must be > 0 and at most the response length when enabled."""
    penalty_factor: float = Field(0.0, ge=0)
    """The penalty of a response that reaches data.max_response_length."""
    log: bool = False
    """verl: also log the penalty; ppoflow always records it (rewards.components['overlong'])."""


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
    reward_manager: Literal["naive", "batch", "prime", "dapo"] = "naive"
    """How reward functions are applied to a batch: naive, batch and prime score each response with
    its reward function; dapo also adds DAPO's overlong penalty (overlong_buffer) as the reward
    component `overlong`."""
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    """DAPO's penalty for responses that run into the last overlong_buffer.len tokens of
    data.max_response_length (with reward_manager=dapo)."""
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
