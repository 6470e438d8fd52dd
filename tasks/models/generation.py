"""Generating responses with a run's actor: the rollout engine, and one device's share of a step's
rollouts (responses, then old and reference log-probs). The in-process host and every worker of a
worker group call the same function, so a share is computed the same way wherever it runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ppoflow.engine.names import RolloutEngineName
from ppoflow.engine.ppo import Rollouts, generate_rollouts
from ppoflow.engine.rollout import HFRolloutEngine, RolloutOutput, SamplingParams


@dataclass(frozen=True)
class RolloutRequest:
    """One step's generation, as the rollouts stage asks for it (actor_rollout_ref.rollout.*)."""

    engine: RolloutEngineName
    n: int
    sampling: SamplingParams
    seed: int
    """The step's sampling seed; response j of prompt i samples from sample_seed(seed, i, j)."""
    generation_batch_size: int
    """rollout.micro_batch_size: responses generated together on one device."""
    log_prob_micro_batch_size: int
    ref_log_prob_micro_batch_size: int


def rollout_engine(name: str, model, tokenizer, batch_size: int = 256) -> HFRolloutEngine:
    """actor_rollout_ref.rollout.name: "hf" (transformers, CPU or GPU). The RolloutEngine protocol is
    the seam for a vLLM engine; until one is wired in, asking for it is a clear error, not a fallback."""
    if name != "hf":
        raise NotImplementedError(
            f"actor_rollout_ref.rollout.name={name}: ppoflow's {name} rollout engine is not available yet; "
            "use actor_rollout_ref.rollout.name=hf (transformers)"
        )
    return HFRolloutEngine(
        model,
        eos_token_ids=_eos_ids(tokenizer, model),
        pad_token_id=tokenizer.pad_token_id,
        batch_size=batch_size,
    )


def _eos_ids(tokenizer, model) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (chat models often have two)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def rollout_share(
    actor: torch.nn.Module,
    reference: torch.nn.Module | None,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    request: RolloutRequest,
    *,
    first_prompt: int = 0,
    on_batch: Callable[[int], None] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> Rollouts:
    """The rollouts of `prompt_ids`, the prompts from `first_prompt` on of a step's batch (none: a
    rank of a group with more ranks than prompts)."""
    if not prompt_ids:
        return Rollouts([], [], [], [], [], [], None if reference is None else [], {})
    engine = rollout_engine(request.engine, actor, tokenizer, request.generation_batch_size)
    return generate_rollouts(
        engine,
        actor,
        reference,
        prompt_ids,
        n=request.n,
        params=request.sampling,
        seed=request.seed,
        pad_token_id=tokenizer.pad_token_id,
        micro_batch_size=request.log_prob_micro_batch_size,
        ref_micro_batch_size=request.ref_log_prob_micro_batch_size,
        first_prompt=first_prompt,
        on_batch=on_batch,
        on_tokens=on_tokens,
    )


def generate_share(
    actor: torch.nn.Module,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingParams,
    seeds: Sequence[int],
    *,
    engine: str,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> RolloutOutput:
    """One response per prompt of `prompt_ids` (validation), response i from `seeds[i]`."""
    if not prompt_ids:
        return RolloutOutput()
    generator = rollout_engine(engine, actor, tokenizer, batch_size)
    return generator.generate(prompt_ids, sampling, seeds=seeds, on_batch=on_batch, on_tokens=on_tokens)
