"""The closed vocabularies of the engine's settings, in verl's spelling: defined here once, used by
the engine's math and by the config schema (conf/) that validates user input against them. This
module imports nothing, so the config can use it without loading torch."""

from typing import Literal

AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
"""algorithm.adv_estimator: how advantages are computed (engine/advantages.py)."""
PolicyLossMode = Literal["vanilla"]
"""verl's actor.policy_loss.loss_mode values that ppoflow implements: the clipped surrogate with dual
clip (`engine/losses.py`)."""

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""*.loss_agg_mode: how per-token losses become one number (engine/masking.py)."""
KLPenalty = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
"""algorithm.kl_penalty / actor.kl_loss_type: the per-token KL estimator (engine/kl.py)."""
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

TOOL_REWARD = "tool"
"""The reward component that holds the sum of the rewards a multi-turn response's tool calls returned
(verl's tool rewards); its weight in the score is reward.weights.tool (0 when unset)."""

BUILTIN_REWARD_COMPONENTS = ("correctness", "format")
"""The components every built-in rule reward returns (addition, openai/gsm8k): what reward.weights
may name beside rm_score when no custom_reward_function is set."""
