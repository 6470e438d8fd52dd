"""The `actor_rollout_ref` section: the policy model, its update, its frozen reference copy and the
rollout engine that samples from it (verl's names and meanings)."""

from typing import Literal

from pydantic import Field

from ppoflow.engine.names import (
    LossAggMode,
    PolicyLossMode,
    RolloutEngineName,
    Strategy,
    ToolCallFormat,
    ToolResponseTruncateSide,
)

from .schema_common import (
    CheckpointConfig,
    DeepSpeedConfig,
    FreeForm,
    FsdpConfig,
    KLType,
    OptimConfig,
    Section,
    Seed,
)


class ModelSource(Section):
    """Where a model and its tokenizer come from, and how they are loaded."""

    path: str | None
    """Hugging Face model directory, a .gguf file, or 'builtin:tiny-addition'."""
    tokenizer_path: str | None = None
    """Tokenizer directory or file; None reads the tokenizer from path."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory to run."""
    use_remove_padding: bool = False
    """Run each micro-batch's sequences packed into one, without padding tokens (verl's key; the
    actor's update and log-prob passes, or the critic's): less time and memory when lengths vary.
    Without it, each micro-batch still leaves out the columns that are padding in all of its rows."""
    enable_gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them: less memory
    in training, more time, the same numbers (verl turns it on for the actor by default)."""
    override_config: FreeForm = {}
    """Entries that replace those of the model's config.json (e.g. attention_dropout: 0.0)."""


class LoraModelSource(ModelSource):
    """A model that trains LoRA adapters instead of all its weights when lora_rank > 0 (through
    peft; verl's keys)."""

    lora_rank: int = Field(0, ge=0)
    """LoRA adapter rank; 0 trains all weights."""
    lora_alpha: int = Field(16, gt=0)
    """LoRA scaling: each adapted weight W becomes W + (lora_alpha / lora_rank)·B·A."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get adapters: 'all-linear' (every linear layer but the output head), a list of
    module names, or one regular expression over module paths."""


class ActorModelConfig(LoraModelSource):
    """The policy model; the reference policy and the rollout engine load the same weights (with
    LoRA, the reference is the same model with its adapters off)."""

    path: str = "builtin:tiny-addition"
    """Hugging Face model directory, a .gguf file, or 'builtin:tiny-addition' (ppoflow's tiny model)."""
    external_lib: str | None = None
    """Python module imported before loading, to register a custom architecture."""
    use_shm: bool = False
    """Copy the model to /dev/shm before loading it."""
    exclude_modules: str | list[str] | None = None
    """Modules that get no LoRA adapters although target_modules names them (names, or one regular
    expression)."""


class PolicyLossConfig(Section):
    """Which policy loss (actor.policy_loss, verl's keys): every loss of verl 0.9.1's registry, each
    tuned by the keys below and by actor.clip_ratio*, tau_pos and tau_neg (docs/ALGORITHMS.md)."""

    loss_mode: PolicyLossMode = "vanilla"
    """vanilla: PPO's clipped surrogate with dual clip; dppo_tv, dppo_kl: DPPO's divergence-bounded
    policy gradient (clip_ratio_low/high bound the divergence, clip_ratio_c truncates the ratio);
    gspo: GSPO's sequence-level ratio; sapo: SAPO's soft gate (tau_pos, tau_neg); gpg: the plain
    policy gradient; clip_cov, kl_cov: the covariance-selected clip or KL term; geo_mean: GMPO's
    geometric-mean ratio; dro: DRO's quadratic log-ratio penalty (dro_beta); cispo: CISPO's clipped
    importance weights; bypass_mode: REINFORCE or PPO-clip on the rollout's log-probs with
    algorithm.rollout_correction's weights and rejection (needs its bypass_mode=true)."""
    clip_cov_ratio: float = Field(0.0002, gt=0)
    """clip_cov: share of the valid tokens whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance of the tokens that may be cut."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance of the tokens that may be cut."""
    kl_cov_ratio: float = Field(0.0002, gt=0)
    """kl_cov: share of the valid tokens that get the KL term."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of its |log ρ| term."""
    dro_beta: float | None = Field(None, gt=0)
    """dro: weight of the quadratic log-ratio penalty; required with loss_mode=dro."""


class ActorConfig(Section):
    """The clipped-surrogate policy update (PPO loss, optional KL loss and entropy bonus)."""

    strategy: Strategy = "fsdp"
    """How training is spread when world_size > 1: fsdp or fsdp2 (torch FSDP2) or deepspeed (ZeRO);
    torch trains in one process only. With world_size 1 every strategy trains in one process."""
    ppo_mini_batch_size: int = Field(256, gt=0)
    """Prompts per optimizer step, over all GPUs; each brings rollout.n responses."""
    ppo_micro_batch_size: int | None = Field(None, gt=0)
    """Deprecated global micro-batch in responses, split over GPUs; use ppo_micro_batch_size_per_gpu."""
    ppo_micro_batch_size_per_gpu: int | None = Field(None, gt=0)
    """Responses per forward/backward pass on one GPU; gradients accumulate over a mini-batch."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token count (ppo_max_token_len_per_gpu) instead of response count."""
    ppo_max_token_len_per_gpu: int = Field(16384, gt=0)
    """Token budget of one micro-batch when use_dynamic_bsz is on."""
    grad_clip: float = Field(1.0, gt=0)
    """Maximum global gradient norm."""
    clip_ratio: float = Field(0.2, gt=0)
    """PPO clip range ε: the ratio is kept within [1-ε, 1+ε]."""
    clip_ratio_low: float | None = Field(None, gt=0)
    """Lower clip range; None uses clip_ratio (see effective_clip_ratio_low)."""
    clip_ratio_high: float | None = Field(None, gt=0)
    """Upper clip range (DAPO's clip-higher); None uses clip_ratio."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound c for negative advantages; must exceed 1."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses are averaged into one number."""
    loss_scale_factor: float | None = Field(None, gt=0)
    """seq-mean-token-sum-norm's constant divisor; None: rollout.response_length (the width every
    response is padded to in verl), so the loss scale does not change from step to step."""
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    """Which policy loss (verl's keys)."""
    tau_pos: float = Field(1.0, gt=0)
    """sapo: the gate's temperature where the advantage is positive."""
    tau_neg: float = Field(1.05, gt=0)
    """sapo: the gate's temperature where the advantage is 0 or negative."""
    calculate_sum_pi_squared: bool = False
    """Also compute Σπ² (the sum of the squared next-token probabilities) in the old-log-prob pass and
    store it in rollouts.sum_pi_squared; always on for the optimal token baselines, which need it."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus; 0 turns it off and, as in verl, a negative weight penalises entropy."""
    use_kl_loss: bool = False
    """Add a KL(actor ‖ reference) term to the loss (GRPO style) instead of to the reward."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """Weight of the KL loss term."""
    kl_loss_type: KLType = "low_var_kl"
    """KL estimator of the loss term: kl/k1, abs, mse/k2, low_var_kl/k3."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over each iteration's rollouts."""
    shuffle: bool = False
    """Shuffle rollouts between PPO epochs."""
    use_prefix_grouper: bool = False
    """Responses of the same prompt in a micro-batch share one forward pass of that prompt (through
    the KV cache), in the update's forward and backward passes and in the old and reference
    log-prob passes: GRPO's rollout.n responses then cost one prompt and n responses. The same
    results up to float rounding; one process only, for models whose KV cache holds only attention
    keys and values, and in the update not under gradient checkpointing (which keeps no cache)."""
    use_torch_compile: bool = False
    """Compile the loss computation with torch.compile."""
    ulysses_sequence_parallel_size: Literal[1] = 1
    """Sequence parallelism is not implemented; only 1 is accepted (verl compatibility)."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Actor optimizer and learning-rate schedule."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """What actor checkpoints hold."""
    fsdp_config: FsdpConfig = Field(default_factory=FsdpConfig)
    """FSDP settings (ignored by the torch strategy)."""
    deepspeed_config: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    """DeepSpeed settings (used only by strategy=deepspeed)."""

    @property
    def effective_clip_ratio_low(self) -> float:
        """The lower clip range in use: clip_ratio_low, else clip_ratio."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def effective_clip_ratio_high(self) -> float:
        """The upper clip range in use: clip_ratio_high, else clip_ratio."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


class RefConfig(Section):
    """The frozen reference policy, used when a KL term is on."""

    log_prob_micro_batch_size: int | None = Field(None, gt=0)
    """Deprecated global micro-batch in responses; use log_prob_micro_batch_size_per_gpu."""
    log_prob_micro_batch_size_per_gpu: int | None = Field(None, gt=0)
    """Responses per reference forward pass on one GPU; None follows the rollout's
    log_prob_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool = False
    """Form forward batches by token count instead of response count."""
    log_prob_max_token_len_per_gpu: int = Field(16384, gt=0)
    """Token budget of one forward batch when log_prob_use_dynamic_bsz is on."""
    ulysses_sequence_parallel_size: Literal[1] = 1
    """Sequence parallelism is not implemented; only 1 is accepted (verl compatibility)."""
    fsdp_config: FsdpConfig = Field(default_factory=FsdpConfig)
    """FSDP settings (ignored by the torch strategy)."""


class ValKwargs(Section):
    """Sampling used for validation (greedy by default)."""

    top_k: int = Field(-1, ge=-1)
    """Sample among the k most likely tokens; -1 (or 0) means all."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    temperature: float = Field(0.0, ge=0)
    """Softmax temperature; 0 with do_sample false is greedy."""
    n: int = Field(1, gt=0)
    """Responses per validation prompt."""
    do_sample: bool = False
    """Sample (true) or decode greedily (false)."""


class MultiTurnConfig(Section):
    """Multi-turn rollouts with tool calls (verl's rollout.multi_turn; docs/CONFIGURATION.md)."""

    enable: bool = False
    """Each response is a conversation: the model may call tools, whose results it reads before it
    goes on (every turn is a row of the turns table)."""
    max_assistant_turns: int | None = Field(None, gt=0)
    """Most assistant turns per response; null: no limit but the response length."""
    max_user_turns: int | None = Field(None, gt=0)
    """Most tool turns per response; null: no limit but the response length."""
    max_parallel_calls: int = Field(1, gt=0)
    """Calls of one assistant turn that run; later ones are dropped (verl)."""
    max_tool_response_length: int = Field(256, gt=0)
    """Longest tool result, in characters, that the model reads (a longer one is cut)."""
    tool_response_truncate_side: ToolResponseTruncateSide = "middle"
    """Which part of a long result is kept: left (its start), right (its end), middle (both ends)."""
    tool_config_path: str | None = None
    """verl's tool config YAML: `tools:` a list of {class_name, config, tool_schema}; class_name is a
    built-in (ppoflow:calculator, ppoflow:gsm8k_answer, verl.tools.gsm8k_tool.Gsm8kTool) or a
    user's class as `file.py:Class` or `module:Class` (found beside the YAML)."""
    format: ToolCallFormat = "hermes"
    """How calls are written: hermes, `<tool_call>{"name": …, "arguments": {…}}</tool_call>`."""
    tool_timeout_s: float = Field(10.0, gt=0, le=3600)
    """ppoflow: longest one call of a user's tool may take (its worker's own time); a slower call
    gives an error result."""
    interaction_config_path: str | None = None
    """verl's simulated-user interactions: not implemented (must be null)."""
    use_inference_chat_template: bool = False
    """verl: re-render earlier turns with the inference template; ppoflow trains the token ids as
    generated (false)."""
    tokenization_sanity_check_mode: Literal["strict", "ignore_strippable", "disable"] = "strict"
    """verl's check that turn-by-turn tokenization equals the whole conversation's; ppoflow never
    re-tokenizes a conversation (it keeps the generated ids), so there is nothing to check."""
    num_repeat_rollouts: int | None = None
    """verl: repeat rollouts per interaction; not implemented (must be null)."""


class RolloutConfig(Section):
    """Response generation. Keys marked vLLM are used only by name=vllm."""

    name: RolloutEngineName = "hf"
    """Engine: hf is transformers' generate (CPU or GPU); vllm needs a GPU and the vllm extra."""
    mode: Literal["sync"] = "sync"
    """Only synchronous rollout is implemented."""
    temperature: float = Field(1.0, ge=0)
    """Softmax temperature while sampling training rollouts."""
    top_k: int = Field(-1, ge=-1)
    """Sample among the k most likely tokens; -1 (or 0) means all."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    do_sample: bool = True
    """Sample (true) or decode greedily (false)."""
    n: int = Field(1, gt=0)
    """Responses sampled per prompt (the group size of GRPO and RLOO)."""
    prompt_length: int | None = Field(None, gt=0)
    """Prompt token budget; None follows data.max_prompt_length."""
    response_length: int | None = Field(None, gt=0)
    """Maximum new tokens; None follows data.max_response_length."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Weight dtype of the engine on GPU."""
    load_format: str = "dummy_dtensor"
    """How vLLM loads its first weights (verl syncs the actor's in afterwards)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM: fraction of GPU memory for weights and KV cache."""
    tensor_model_parallel_size: int = Field(1, gt=0)
    """vLLM: GPUs one model is split over."""
    max_num_batched_tokens: int = Field(8192, gt=0)
    """vLLM: tokens scheduled per engine step."""
    max_num_seqs: int = Field(1024, gt=0)
    """vLLM: sequences in flight at once."""
    enforce_eager: bool = True
    """vLLM: run without CUDA graphs."""
    free_cache_engine: bool = True
    """vLLM: release the KV cache after generating, for the update's memory."""
    enable_chunked_prefill: bool = True
    """vLLM: split long prefills into chunks."""
    micro_batch_size: int = Field(256, gt=0)
    """hf engine: responses generated together on one device (a device's share of a step is
    generated in batches of this many)."""
    log_prob_micro_batch_size: int | None = Field(None, gt=0)
    """Deprecated global micro-batch in responses; use log_prob_micro_batch_size_per_gpu."""
    log_prob_micro_batch_size_per_gpu: int | None = Field(None, gt=0)
    """Responses per forward pass when recomputing old log-probs on one GPU."""
    log_prob_use_dynamic_bsz: bool = False
    """Form forward batches by token count instead of response count."""
    log_prob_max_token_len_per_gpu: int = Field(16384, gt=0)
    """Token budget of one forward batch when log_prob_use_dynamic_bsz is on."""
    calculate_log_probs: bool = False
    """Also return the engine's own log-probs of the sampled tokens (rollout_log_probs)."""
    seed: Seed | None = None
    """Sampling seed of training rollouts; each iteration derives its own from it. None follows
    trainer.seed (verl's default is 0)."""
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)
    """Sampling used for validation."""
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tool calls."""


class ActorRolloutRefConfig(Section):
    """Policy, reference policy and rollout, which share one model (verl's hybrid engine)."""

    hybrid_engine: Literal[True] = True
    """Actor and rollout share weights; verl and ppoflow support only true."""
    model: ActorModelConfig = Field(default_factory=ActorModelConfig)
    """The policy model."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The policy update."""
    ref: RefConfig = Field(default_factory=RefConfig)
    """The reference policy."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Response generation."""
