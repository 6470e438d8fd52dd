"""The closed vocabularies of the engine's settings, in verl's spelling: defined here once, used by
the engine's math and by the config schema (conf/) that validates user input against them. This
module imports nothing, so the config can use it without loading torch."""

from typing import Literal

AdvEstimator = Literal[
    "gae",
    "grpo",
    "grpo_vectorized",
    "gdpo",
    "grpo_passk",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
]
"""algorithm.adv_estimator: how advantages are computed, verl 0.9.1's ADV_ESTIMATOR_REGISTRY
(engine/advantages.py)."""
PolicyLossMode = Literal[
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
]
"""actor.policy_loss.loss_mode: verl 0.9.1's POLICY_LOSS_REGISTRY (engine/policy_losses.py)."""
BypassLossType = Literal["ppo_clip", "reinforce"]
"""algorithm.rollout_correction.loss_type: the loss of bypass mode (engine/policy_losses.py)."""
RolloutISLevel = Literal["token", "sequence"]
"""algorithm.rollout_correction.rollout_is: importance weights per token or per sequence
(engine/rollout_correction.py)."""
RolloutRSOption = Literal[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]
"""One criterion of algorithm.rollout_correction.rollout_rs (a comma-separated list of them):
rejection sampling by a divergence between the trainer's and the rollout's log-probs."""

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
"""*.loss_agg_mode: how per-token losses become one number (engine/masking.py)."""
KLPenalty = Literal[
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
]
"""algorithm.kl_penalty / actor.kl_loss_type: the per-token KL estimator (engine/kl.py); a "+"
suffix keeps the value and takes the gradient of k2 (verl's straight-through estimator)."""
WarmupStyle = Literal["constant", "cosine"]
"""*.optim.warmup_style: the LR schedule after warmup (engine/optim.py)."""
Truncation = Literal["error", "left", "right", "middle"]
"""data.truncation: what happens to a prompt longer than data.max_prompt_length."""
Gsm8kMethod = Literal["strict", "flexible"]
"""reward.gsm8k_method: verl's GSM8K answer extraction (engine/gsm8k.py)."""
PFReweightMethod = Literal["pow", "max_min", "max_random"]
"""algorithm.pf_ppo.reweight_method: PF-PPO's sample weighting (engine/pf_ppo.py)."""
FinishReason = Literal["stop", "length"]
"""Why a response ended: an EOS token, or the length limit."""
ToolCallFormat = Literal["hermes"]
"""actor_rollout_ref.rollout.multi_turn.format: how tool calls are written (engine/tool_calls.py)."""
ToolResponseTruncateSide = Literal["left", "middle", "right"]
"""multi_turn.tool_response_truncate_side: which part of a long tool response is kept (verl's: left
keeps the start, right the end, middle both ends)."""
KLControlType = Literal["fixed", "adaptive"]
"""algorithm.kl_ctrl.type: β stays, or follows the measured KL toward target_kl (engine/kl.py)."""
RolloutEngineName = Literal["hf", "vllm"]
"""actor_rollout_ref.rollout.name: which engine generates."""
VLLM_DUMMY_LOAD_FORMATS = ("dummy_dtensor", "dummy", "dummy_hf", "dummy_megatron")
"""verl's load formats that start the vLLM engine with random weights (vLLM's `dummy`); the actor's
are synced in before the first generation."""
VLLM_LOAD_FORMATS = (*VLLM_DUMMY_LOAD_FORMATS, "auto", "safetensors", "pt")
"""actor_rollout_ref.rollout.load_format values the vLLM engine starts with: a dummy format or one of
vLLM's own readers."""
VLLM_MAX_TEMPERATURE = 2.0
"""vLLM samples with temperatures in [0, 2]."""

Strategy = Literal["fsdp", "fsdp2", "deepspeed", "torch"]
"""How an update is spread over devices: torch (one process), fsdp/fsdp2 (torch's FSDP2), deepspeed."""

RM_SCORE = "rm_score"
"""The reward component that holds a reward model's score of a response (verl's `rm_scores`); its
weight in the score is reward.weights.rm_score."""

BUILTIN_TOOL_CLASSES = ("ppoflow:calculator", "ppoflow:gsm8k_answer", "verl.tools.gsm8k_tool.Gsm8kTool")
"""Tool config class_names of ppoflow's built-in tools (engine/tools.py); verl's GSM8K tool is one."""

OVERLONG_REWARD = "overlong"
"""The reward component that holds DAPO's overlong penalty (reward_model.reward_manager=dapo), ≤ 0;
its weight in the score is reward.weights.overlong (1 when unset, as verl adds it)."""

TOOL_REWARD = "tool"
"""The reward component that holds the sum of the rewards a multi-turn response's tool calls returned
(verl's tool rewards); its weight in the score is reward.weights.tool (0 when unset)."""

BUILTIN_REWARD_COMPONENTS = ("correctness", "format")
"""The components every built-in rule reward returns (addition, openai/gsm8k): what reward.weights
may name beside rm_score when no custom_reward_function is set."""
