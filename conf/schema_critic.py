"""The `critic` section: the value model trained with a clipped value loss (used by adv_estimator=gae).
Keys left at None follow the actor; PPOFlowConfig fills them in so the section stands alone."""

from typing import Literal

from pydantic import Field

from ppoflow.engine.names import LossAggMode, Strategy

from .schema_actor import LoraModelSource
from .schema_common import (
    CheckpointConfig,
    DeepSpeedConfig,
    FsdpConfig,
    OptimConfig,
    Section,
)


class CriticOptimConfig(OptimConfig):
    """The critic's optimizer: the actor's, with verl's larger critic learning rate."""

    lr: float = Field(1e-5, gt=0)
    """Peak learning rate."""


class CriticModelConfig(LoraModelSource):
    """The value model: a language model with a scalar head (with LoRA, the head trains whole)."""

    path: str | None = None
    """Hugging Face model directory, a .gguf file or 'builtin:…'; None uses actor_rollout_ref.model.path."""
    fsdp_config: FsdpConfig = Field(default_factory=FsdpConfig)
    """FSDP settings (ignored by the torch strategy)."""


class CriticConfig(Section):
    """The value-function update."""

    strategy: Strategy = "fsdp"
    """How training is spread when world_size > 1: fsdp or fsdp2 (torch FSDP2) or deepspeed (ZeRO);
    torch trains in one process only. With world_size 1 every strategy trains in one process."""
    rollout_n: int | None = Field(None, gt=0)
    """Responses per prompt; always actor_rollout_ref.rollout.n (None fills it in)."""
    optim: CriticOptimConfig = Field(default_factory=CriticOptimConfig)
    """Critic optimizer and learning-rate schedule."""
    model: CriticModelConfig = Field(default_factory=CriticModelConfig)
    """The value model."""
    ppo_mini_batch_size: int | None = Field(None, gt=0)
    """Prompts per optimizer step, over all GPUs; None uses actor_rollout_ref.actor.ppo_mini_batch_size."""
    ppo_micro_batch_size: int | None = Field(None, gt=0)
    """Deprecated global micro-batch in responses; use ppo_micro_batch_size_per_gpu."""
    ppo_micro_batch_size_per_gpu: int | None = Field(None, gt=0)
    """Responses per forward/backward pass on one GPU."""
    forward_micro_batch_size: int | None = Field(None, gt=0)
    """Deprecated global micro-batch for computing values; use forward_micro_batch_size_per_gpu."""
    forward_micro_batch_size_per_gpu: int | None = Field(None, gt=0)
    """Responses per value forward pass on one GPU; None follows ppo_micro_batch_size_per_gpu."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token count instead of response count."""
    ppo_max_token_len_per_gpu: int = Field(32768, gt=0)
    """Token budget of one update micro-batch when use_dynamic_bsz is on."""
    forward_max_token_len_per_gpu: int = Field(32768, gt=0)
    """Token budget of one value forward batch when use_dynamic_bsz is on."""
    ppo_epochs: int | None = Field(None, gt=0)
    """Passes over each iteration's rollouts; None uses actor_rollout_ref.actor.ppo_epochs."""
    shuffle: bool = False
    """Shuffle rollouts between epochs."""
    grad_clip: float = Field(1.0, gt=0)
    """Maximum global gradient norm."""
    cliprange_value: float = Field(0.5, gt=0)
    """Value clip range: new values stay within this distance of the old ones."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token value losses are averaged into one number."""
    loss_scale_factor: float | None = Field(None, gt=0)
    """seq-mean-token-sum-norm's constant divisor; None follows actor_rollout_ref.actor.loss_scale_factor
    (as verl's), and then rollout.response_length."""
    ulysses_sequence_parallel_size: Literal[1] = 1
    """Sequence parallelism is not implemented; only 1 is accepted (verl compatibility)."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """What critic checkpoints hold."""
    deepspeed_config: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    """DeepSpeed settings (used only by strategy=deepspeed)."""
