"""The PPO stages as engine calls: what each pipeline task computes, without any file IO.

Each function takes plain lists (as read from parquet) or tensors and returns the same, so a task
is: read parquet → one call here → write parquet. An in-process loop calling these in order is a
whole PPO iteration (the tests do exactly that).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .advantages import AdvantageInputs, AdvantageSpec, compute_advantages
from .batching import ForwardBatching
from .forward import SequenceBatch, compute_log_probs, compute_log_probs_and_sum_pi_squared
from .kl import KLPenalty, apply_kl_penalty
from .multi_turn import MultiTurnLimits, ToolRunner, Trajectory, TurnCodec, rollout_output, run_multi_turn
from .rollout import (
    RolloutEngine,
    SamplingParams,
    left_pad,
    right_pad,
    row_prefixes,
    sample_seed,
)
from .rollout_correction import Correction, RolloutCorrectionSettings, rollout_correction
from .tools import ToolContext


def build_sequence_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    response_width: int | None = None,
    response_masks: Sequence[Sequence[int]] | None = None,
) -> SequenceBatch:
    """Left-pad the prompts, right-pad the responses (to `response_width` if given). With
    `response_masks` (multi-turn: 0 on tool tokens), those are the loss mask and every response
    token is attended (`SequenceBatch.response_attention`)."""
    prompts, prompt_mask = left_pad(prompt_ids, pad_token_id)
    responses, attention = right_pad(response_ids, pad_token_id, width=response_width)
    if response_masks is None:
        return SequenceBatch(prompts, prompt_mask, responses, attention)
    loss_mask = right_pad(response_masks, 0.0, width=responses.shape[1], dtype=torch.float32)[0]
    return SequenceBatch(prompts, prompt_mask, responses, loss_mask, attention)


def unpad(values: torch.Tensor, batch_or_mask: SequenceBatch | torch.Tensor) -> list[list[float]]:
    """(N, T) → per-row lists of the response positions (the parquet list-column form): every token
    of the response (`SequenceBatch.attended`, tool tokens included), or the 1s of a mask."""
    mask = batch_or_mask.attended if isinstance(batch_or_mask, SequenceBatch) else batch_or_mask
    return row_prefixes(values, mask.sum(-1).long().tolist())


def pad_rows(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Per-row lists → (N, width) float tensor, 0 past each row's end."""
    return right_pad(rows, 0.0, width=width, dtype=torch.float32)[0]


@dataclass
class Rollouts:
    """N = len(prompt_ids)·n responses, ordered prompt by prompt, `sample_index` 0..n−1 within one."""

    prompt_index: list[int]
    sample_index: list[int]
    response_ids: list[list[int]]
    finish_reasons: list[str]
    rollout_log_probs: list[list[float]]
    old_log_probs: list[list[float]]
    ref_log_probs: list[list[float]] | None
    seconds: dict[str, float]
    """Wall seconds of each phase, by verl's timer names: gen, old_log_prob, ref (with a reference)."""
    trajectories: list[Trajectory] | None = None
    """Multi-turn: each response's turns, response mask (0 on tool tokens) and tool rewards."""
    sum_pi_squared: list[list[float]] | None = None
    """Σ_v π(v | s_t)² of each response token from the old-log-prob pass (0 on tool tokens), when
    asked for (the optimal token baselines, actor.calculate_sum_pi_squared)."""


@dataclass(frozen=True)
class MultiTurn:
    """What a multi-turn rollout needs beside the engine: its limits, the tokenizer's side, the tools
    and each prompt's context for them (`contexts[i]`: prompt i of the batch given)."""

    limits: MultiTurnLimits
    codec: TurnCodec
    tools: ToolRunner
    contexts: Sequence[ToolContext]


def generate_rollouts(
    engine: RolloutEngine,
    actor: torch.nn.Module,
    reference: torch.nn.Module | None,
    prompt_ids: Sequence[Sequence[int]],
    *,
    n: int,
    params: SamplingParams,
    seed: int,
    pad_token_id: int,
    batching: ForwardBatching | int,
    ref_batching: ForwardBatching | int | None = None,
    recompute_old_log_probs: bool = True,
    sum_pi_squared: bool = False,
    share_prompts: bool = False,
    first_prompt: int = 0,
    on_batch: Callable[[int], None] | None = None,
    on_tokens: Callable[[int], None] | None = None,
    multi_turn: MultiTurn | None = None,
) -> Rollouts:
    """Sample n responses per prompt, then recompute old (actor) and reference log-probs with the
    trainer's forward pass at the sampling temperature, in the micro-batches of `batching` (and
    `ref_batching`, default the same). Without
    `recompute_old_log_probs` (verl's rollout_correction.bypass_mode) the old log-probs are the
    engine's own, and there is no actor pass (no old_log_prob timer); `sum_pi_squared` (which needs
    that pass) also keeps Σπ² of every token from it. `share_prompts`
    (actor.use_prefix_grouper): a prompt's n responses share its forward pass in both passes
    (`forward.shared_prompt_logits`). Response j of prompt i samples from
    `sample_seed(seed, first_prompt + i, j)`: a device given the prompts from `first_prompt` on of a
    step's batch generates what one device given the whole batch would. `multi_turn`: each response
    is a multi-turn trajectory (engine/multi_turn.py); the passes read its tool tokens and give them
    log-prob 0."""
    repeated = [list(p) for p in prompt_ids for _ in range(n)]
    seeds = [sample_seed(seed, first_prompt + i, j) for i in range(len(prompt_ids)) for j in range(n)]
    started = time.perf_counter()
    trajectories, masks = None, None
    if multi_turn is None:
        out = engine.generate(repeated, params, seeds=seeds, on_batch=on_batch, on_tokens=on_tokens)
    else:
        trajectories = run_multi_turn(
            engine,
            repeated,
            params,
            seeds=seeds,
            contexts=[multi_turn.contexts[i] for i in range(len(prompt_ids)) for _ in range(n)],
            codec=multi_turn.codec,
            tools=multi_turn.tools,
            limits=multi_turn.limits,
            on_tokens=on_tokens,
        )
        out = rollout_output(trajectories)
        masks = [t.response_mask for t in trajectories]
        if on_batch is not None:
            on_batch(len(repeated))
    temperature = params.logit_temperature
    generated = time.perf_counter()
    seconds = {"gen": generated - started}
    if recompute_old_log_probs or reference is not None:  # the padded batch the trainer's passes take
        batch = build_sequence_batch(
            repeated, out.response_ids, pad_token_id=pad_token_id, response_masks=masks
        )
    squares = None
    if recompute_old_log_probs:
        passes = dict(temperature=temperature, batching=batching, share_prompts=share_prompts)
        if sum_pi_squared:
            old, square = compute_log_probs_and_sum_pi_squared(actor, batch, **passes)
            squares = unpad(square, batch)
        else:
            old = compute_log_probs(actor, batch, **passes)
        old_log_probs = unpad(old, batch)
        seconds["old_log_prob"] = time.perf_counter() - generated
    elif sum_pi_squared:
        raise ValueError("sum_pi_squared comes from the old-log-prob pass, which bypass mode skips")
    else:
        old_log_probs = [list(row) for row in out.rollout_log_probs]
    ref = None
    if reference is not None:
        started = time.perf_counter()
        ref = unpad(
            compute_log_probs(
                reference,
                batch,
                temperature=temperature,
                batching=ref_batching or batching,
                share_prompts=share_prompts,
            ),
            batch,
        )
        seconds["ref"] = time.perf_counter() - started
    return Rollouts(
        prompt_index=[i for i in range(len(prompt_ids)) for _ in range(n)],
        sample_index=[j for _ in range(len(prompt_ids)) for j in range(n)],
        response_ids=out.response_ids,
        finish_reasons=list(out.finish_reasons),
        rollout_log_probs=out.rollout_log_probs,
        old_log_probs=old_log_probs,
        ref_log_probs=ref,
        seconds=seconds,
        trajectories=trajectories,
        sum_pi_squared=squares,
    )


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """token_level_scores (N, T): each sequence's scalar score at its last valid token (the last 1
    of `response_mask`: in a multi-turn response, the model's last token, never a tool's), 0
    elsewhere; a row without a valid token has its score in the last column, as verl's reward
    managers place it (at valid_response_length − 1 = −1): the group estimators count it, the
    token-wise ones (GAE, REINFORCE++) skip a masked position."""
    token_level = torch.zeros_like(response_mask, dtype=torch.float32)
    if token_level.shape[1] == 0:
        return token_level
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = ((response_mask != 0).long() * positions).amax(dim=-1) - 1  # −1 for a row without tokens
    token_level[torch.arange(len(scores)), last] = scores.float()
    return token_level


@dataclass(frozen=True)
class AdvantageSettings:
    """algorithm.* as the advantage computation reads it (built once by the run plan)."""

    estimator: AdvantageSpec
    use_kl_in_reward: bool
    kl_penalty: KLPenalty
    rollout_correction: RolloutCorrectionSettings | None = None
    """Decoupled mode: importance weights and rejection of the old log-probs against the rollout's,
    taken before the estimator as verl's trainer does (at least its rollout_corr/* diagnostics);
    None in bypass mode, where the old log-probs are the rollout's."""


@dataclass(frozen=True)
class StepTensors:
    """What the advantage stage reads of a step besides its scores: (N, T) per-token tensors and
    (N,) per-row ones; None where the run has none."""

    response_mask: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    group_id: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    reward_components: Mapping[str, torch.Tensor] | None = None
    """Component name → (N,) its value per response (gdpo)."""


@dataclass
class AdvantageResult:
    token_level_rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    current_kl: float | None
    correction: Correction | None
    """Decoupled rollout correction's weights, rejection mask and rollout_corr/* metrics."""


def compute_advantage_stage(
    scores: torch.Tensor, step: StepTensors, *, settings: AdvantageSettings, kl_coef: float
) -> AdvantageResult:
    """Scores → token-level rewards (minus β·KL when use_kl_in_reward) → decoupled rollout correction
    (its rejected tokens leave the mask) → advantages and returns, in verl's order."""
    mask = step.response_mask
    token_level_scores = place_scores(scores, mask)
    current_kl = None
    rewards = token_level_scores
    if settings.use_kl_in_reward:
        if step.old_log_probs is None or step.ref_log_probs is None:
            raise ValueError("use_kl_in_reward needs old_log_probs and ref_log_probs")
        rewards, current_kl = apply_kl_penalty(
            token_level_scores,
            step.old_log_probs,
            step.ref_log_probs,
            mask,
            kl_coef=kl_coef,
            kind=settings.kl_penalty,
        )
    correction = None
    old, rollout = step.old_log_probs, step.rollout_log_probs
    if settings.rollout_correction is not None and old is not None and rollout is not None:
        correction = rollout_correction(old, rollout, mask, settings.rollout_correction)
    inputs = AdvantageInputs(
        token_level_rewards=rewards,
        response_mask=correction.response_mask if correction is not None else mask,
        group_id=step.group_id,
        values=step.values,
        reward_baselines=step.reward_baselines,
        old_log_probs=step.old_log_probs,
        sum_pi_squared=step.sum_pi_squared,
        rollout_is_weights=correction.weights if correction is not None else None,
        reward_components=step.reward_components,
    )
    advantages, returns = compute_advantages(settings.estimator, inputs)
    return AdvantageResult(rewards, advantages, returns, current_kl, correction)
