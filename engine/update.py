"""Actor and critic update loops: PPO epochs × mini-batches (one optimizer step each) ×
micro-batches (gradient accumulation).

Each micro-batch loss is normalised by the counts of its whole mini-batch
(`masking.mini_batch_aggregation`), so splitting a mini-batch into micro-batches never changes the
gradient.
Metrics use verl's names; per-mini-batch values are averaged over the update.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .batching import micro_batches
from .forward import SequenceBatch, inner_model, model_device, policy_forward, value_forward
from .kl import KLPenalty, kl_penalty
from .losses import compute_value_loss
from .masking import Aggregation, LossAggMode, agg_loss, masked_mean, mini_batch_aggregation
from .metrics import reduce_update_steps
from .parallel import LocalStepper
from .policy_losses import PolicyLossSpec, PolicyTokens, compute_policy_loss

Stepper = LocalStepper
"""Backward, optimizer step and metric reduction of one rank (engine/parallel.py)."""


@dataclass(frozen=True)
class ActorUpdateSettings:
    """One actor update, in verl's names (`actor_rollout_ref.actor.*` unless said). Built once per
    run from the config (tasks/pipeline/update_settings.py); the config holds every default."""

    ppo_epochs: int
    mini_batch_size: int
    """Rows per optimizer step: ppo_mini_batch_size prompts × rollout.n responses."""
    micro_batch_size: int
    """ppo_micro_batch_size_per_gpu: rows per forward/backward (gradient accumulation)."""
    temperature: float
    """The temperature the rollouts' old log-probs were computed at (rollout.temperature; 1 if greedy)."""
    policy_loss: PolicyLossSpec
    """policy_loss.loss_mode and its settings (engine/policy_losses.py)."""
    loss_agg_mode: LossAggMode
    loss_scale_factor: float
    """seq-mean-token-sum-norm's divisor: actor.loss_scale_factor, else rollout.response_length (the
    width verl's agent loop pads every response to)."""
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: KLPenalty
    grad_clip: float
    shuffle: bool
    gradient_checkpointing: bool = field(default=False, metadata={"cache_key": False})
    """model.enable_gradient_checkpointing: each layer's activations are recomputed in the backward
    pass instead of kept (memory for time; the same numbers, so no part of the cache key)."""
    share_prompts: bool = field(default=False, metadata={"cache_key": False})
    """actor.use_prefix_grouper: the rows of a micro-batch that hold the same prompt share one
    forward pass of it (`forward.shared_prompt_logits`; the same numbers up to float rounding, so
    no part of the cache key)."""
    max_token_len: int | None = None
    """use_dynamic_bsz: micro-batches by token budget, ppo_max_token_len_per_gpu
    (`batching.micro_batches`); None: micro_batch_size rows each."""
    remove_padding: bool = False
    """model.use_remove_padding: each micro-batch runs packed into one sequence (engine/packing.py;
    the same numbers up to float rounding, but other kernels: part of the cache key)."""


@dataclass(frozen=True)
class CriticUpdateSettings:
    """One critic update, in verl's names (`critic.*`). Built once per run from the config."""

    ppo_epochs: int
    mini_batch_size: int
    """Rows per optimizer step: ppo_mini_batch_size prompts × rollout.n responses."""
    micro_batch_size: int
    """ppo_micro_batch_size_per_gpu."""
    cliprange_value: float
    loss_agg_mode: LossAggMode
    loss_scale_factor: float
    """critic.loss_scale_factor (seq-mean-token-sum-norm), else rollout.response_length."""
    grad_clip: float
    shuffle: bool
    gradient_checkpointing: bool = field(default=False, metadata={"cache_key": False})
    """critic.model.enable_gradient_checkpointing (see ActorUpdateSettings)."""
    max_token_len: int | None = None
    """critic.use_dynamic_bsz: micro-batches by token budget, critic.ppo_max_token_len_per_gpu."""
    remove_padding: bool = False
    """critic.model.use_remove_padding (see ActorUpdateSettings)."""


@dataclass
class UpdateResult:
    """One row per optimizer step (epoch, mini_batch and the metrics of that step)."""

    steps: list[dict[str, float]]

    def mean_metrics(self) -> dict[str, float]:
        """verl's reduction: each metric averaged over the optimizer steps of the update."""
        return reduce_update_steps(self.steps)


def count_steps(n_rows: int, size: int, epochs: int) -> int:
    """Optimizer steps an update takes (for progress reporting)."""
    return epochs * -(-n_rows // size)


def mini_batches(n_rows: int, size: int, *, epochs: int, shuffle: bool, seed: int):
    """(epoch, mini_batch, row ids), one per optimizer step: `epochs` passes in chunks of `size`."""
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n_rows, generator=generator) if shuffle else torch.arange(n_rows)
        for index, rows in enumerate(order.split(size)):
            yield epoch, index, rows


Cells = tuple[torch.Tensor, slice]
MicroLoss = Callable[
    [Cells, SequenceBatch, Aggregation], tuple[torch.Tensor, dict[str, float], dict[str, float]]
]
"""(the micro-batch's cells of the mini-batch's (N, T) per-token tensors: its row ids and its
response columns; its rows without padding columns; the mini-batch's aggregation) →
(loss, summed metrics, token-mean metrics)."""


@contextmanager
def gradient_checkpointing(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Turn transformers' activation checkpointing on for the duration (non-reentrant, as verl)."""
    module = inner_model(model)  # under a DeepSpeed engine or a peft model
    if not enabled:
        yield
        return
    if not getattr(module, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(module).__name__} does not support enable_gradient_checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(module, "activation_checkpointing_enable"):  # transformers ≥ 5.24's names
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        disable = module.activation_checkpointing_disable
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        disable = module.gradient_checkpointing_disable
    try:
        yield
    finally:
        disable()


def _optimize(
    model: torch.nn.Module,
    stepper: Stepper,
    batch: SequenceBatch,
    settings: ActorUpdateSettings | CriticUpdateSettings,
    seed: int,
    role: str,
    micro_loss: MicroLoss,
    on_step: Callable[[int], None] | None,
) -> UpdateResult:
    """The loop both updates share: epochs × mini-batches (one clipped optimizer step each) ×
    micro-batches (gradient accumulation over the whole mini-batch's aggregation counts). With several
    ranks, each takes its contiguous share of every mini-batch (`stepper.rank` of `stepper.world`)
    and the strategy reduces the gradients. Per step, loss terms are summed over micro-batches (each
    is already a share of the mini-batch loss) and token-level metrics are weighted by each
    micro-batch's share of the valid tokens, then both are summed over the ranks."""
    model.train()
    device = model_device(model)
    steps: list[dict[str, float]] = []
    s = settings
    with gradient_checkpointing(model, s.gradient_checkpointing):
        for epoch, index, rows in mini_batches(
            len(batch), s.mini_batch_size, epochs=s.ppo_epochs, shuffle=s.shuffle, seed=seed
        ):
            mask = batch.response_mask[rows]
            aggregation = mini_batch_aggregation(mask, s.loss_agg_mode, s.loss_scale_factor)
            step: dict[str, float] = defaultdict(float)
            own = rows.chunk(stepper.world)[stepper.rank]
            micros = micro_batches(
                own,
                batch.prompt_mask,
                batch.attended,
                size=s.micro_batch_size,
                max_tokens=s.max_token_len,
                packed=s.remove_padding,
                agree=stepper.agree,  # every rank runs as many as the one that needs most
            )
            for position, micro in enumerate(micros):
                part = batch.select(micro).without_padding().to(device)
                cells = (micro, slice(0, part.response_ids.shape[1]))
                loss, summed, token_means = micro_loss(cells, part, aggregation)
                stepper.backward(loss, last=position == len(micros) - 1)
                share = float(part.response_mask.sum()) / max(1.0, float(mask.sum()))
                for name, value in summed.items():
                    step[name] += value
                for name, value in token_means.items():
                    step[name] += value * share
            step = stepper.reduce(step) | {"epoch": epoch, "mini_batch": index}
            step[f"{role}/grad_norm"] = stepper.step(s.grad_clip)
            step[f"{role}/lr"] = stepper.lr
            steps.append(step)
            if on_step is not None:
                on_step(1)
    return UpdateResult(steps)


def update_actor(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: SequenceBatch,
    *,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    settings: ActorUpdateSettings,
    seed: int,
    rollout_is_weights: torch.Tensor | None = None,
    on_step: Callable[[int], None] | None = None,
    stepper: Stepper | None = None,
) -> UpdateResult:
    """Policy update over `batch` (N rows) with settings.policy_loss: one `actor/*` metrics row per
    optimizer step; `seed` orders the mini-batches when settings.shuffle and seeds the losses'
    random choices (clip_cov). `rollout_is_weights` (N, T): decoupled rollout correction's weights
    (its rejected tokens are already 0 in batch.response_mask). `stepper` spreads it over ranks
    (engine/parallel.py); by default it runs in this process."""
    if settings.use_kl_loss and ref_log_probs is None:
        raise ValueError("use_kl_loss needs ref_log_probs")
    s = settings
    device = model_device(model)
    old_log_probs, advantages = old_log_probs.to(device), advantages.to(device)
    ref_log_probs = ref_log_probs.to(device) if ref_log_probs is not None else None
    weights = rollout_is_weights.to(device) if rollout_is_weights is not None else None
    stepper = stepper or LocalStepper(model, optimizer)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + stepper.rank)

    def micro_loss(cells, part, aggregation):
        log_probs, entropy = policy_forward(
            model,
            part,
            temperature=s.temperature,
            with_entropy=True,
            entropy_grad=s.entropy_coeff != 0,
            share_prompts=s.share_prompts,
            remove_padding=s.remove_padding,
        )
        tokens = PolicyTokens(
            old_log_probs[cells],
            log_probs,
            advantages[cells],
            part.response_mask,
            weights[cells] if weights is not None else None,
            generator,
        )
        pg_loss, pg_metrics = compute_policy_loss(s.policy_loss, tokens, aggregation)
        entropy_loss = agg_loss(entropy, part.response_mask, aggregation)
        loss = pg_loss - s.entropy_coeff * entropy_loss  # with coefficient 0: no graph, pg_loss exactly
        summed = {"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy_loss.item()}
        if s.use_kl_loss:
            kl_loss = agg_loss(
                kl_penalty(log_probs, ref_log_probs[cells], s.kl_loss_type), part.response_mask, aggregation
            )
            loss = loss + s.kl_loss_coef * kl_loss
            summed["actor/kl_loss"] = kl_loss.item()
            pg_metrics = pg_metrics | {"actor/kl_coef": s.kl_loss_coef}  # a share-weighted constant
        return loss, summed, pg_metrics

    return _optimize(model, stepper, batch, settings, seed, "actor", micro_loss, on_step)


def update_critic(
    critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: SequenceBatch,
    *,
    values: torch.Tensor,
    returns: torch.Tensor,
    settings: CriticUpdateSettings,
    seed: int,
    on_step: Callable[[int], None] | None = None,
    stepper: Stepper | None = None,
) -> UpdateResult:
    """Clipped value-loss regression of V(s_t) onto `returns`: one `critic/*` row per optimizer step."""
    s = settings
    device = model_device(critic)
    values, returns = values.to(device), returns.to(device)

    def micro_loss(cells, part, aggregation):
        vpreds = value_forward(critic, part, remove_padding=s.remove_padding)
        vf_loss, vf_metrics = compute_value_loss(
            vpreds,
            values[cells],
            returns[cells],
            part.response_mask,
            cliprange_value=s.cliprange_value,
            agg=aggregation,
        )
        token_means = vf_metrics | {
            "critic/vpred_mean": masked_mean(vpreds.detach(), part.response_mask).item()
        }
        return vf_loss, {"critic/vf_loss": vf_loss.item()}, token_means

    stepper = stepper or LocalStepper(critic, optimizer)
    return _optimize(critic, stepper, batch, settings, seed, "critic", micro_loss, on_step)
