"""A whole PPO run in-process, composed only of engine calls (no Prefect, no files but the model)."""

from __future__ import annotations

import torch

from ppoflow.engine.forward import compute_values
from ppoflow.engine.lora import AdaptersOff, LoraSpec, add_adapters
from ppoflow.engine.models import load_actor, load_critic, load_reference, load_tokenizer
from ppoflow.engine.optim import build_optimizer
from ppoflow.engine.ppo import (
    StepTensors,
    build_sequence_batch,
    compute_advantage_stage,
    generate_rollouts,
    pad_rows,
)
from ppoflow.engine.rewards import addition_components, combine_components
from ppoflow.engine.rollout import HFRolloutEngine, SamplingParams
from ppoflow.engine.tiny import all_addition_problems, greedy_accuracy, sample_addition_problems
from ppoflow.engine.update import update_actor, update_critic

from .settings import actor_settings, advantage_settings, critic_settings, optim_settings

WEIGHTS = {"correctness": 0.9, "format": 0.1}


def run_ppo(
    model_dir,
    *,
    seed: int,
    iterations: int,
    estimator: str = "gae",
    n: int = 1,
    batch_prompts: int = 64,
    mini_batch_prompts: int = 16,
    micro_batch_size: int = 16,
    actor_lr: float = 2e-3,
    critic_lr: float = 2e-3,
    ppo_epochs: int = 1,
    warmup_steps: int = 0,
    critic_epochs: int | None = None,
    critic_mini_batch_prompts: int | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    lora: LoraSpec | None = None,
) -> list[float]:
    """Greedy validation accuracy before training and after each iteration. With `lora`, the actor
    trains adapters only and the reference is its base with the adapters off."""
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_dir)
    if lora is None:
        actor, reference = load_actor(model_dir), load_reference(model_dir)
    else:
        actor = add_adapters(load_actor(model_dir), lora)
        reference = AdaptersOff(actor)
    use_critic = estimator == "gae"
    critic = load_critic(model_dir) if use_critic else None
    actor_opt, actor_sched = build_optimizer(
        actor, optim_settings(lr=actor_lr, total_steps=iterations, warmup_steps=warmup_steps, betas=betas)
    )
    if use_critic:
        critic_opt, critic_sched = build_optimizer(
            critic, optim_settings(lr=critic_lr, total_steps=iterations)
        )
    engine = HFRolloutEngine(
        actor, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    problems = sample_addition_problems(iterations * batch_prompts, seed=seed)
    val = all_addition_problems()
    accuracies = [greedy_accuracy(actor, tokenizer, val)]
    pad = tokenizer.pad_token_id
    for it in range(iterations):
        chunk = problems[it * batch_prompts : (it + 1) * batch_prompts]
        prompt_ids = [tokenizer(p.prompt)["input_ids"] for p in chunk]
        ro = generate_rollouts(
            engine,
            actor,
            reference,
            prompt_ids,
            n=n,
            params=params,
            seed=seed * 1000 + it,
            pad_token_id=pad,
            batching=64,
        )
        repeated = [prompt_ids[i] for i in ro.prompt_index]
        batch = build_sequence_batch(repeated, ro.response_ids, pad_token_id=pad)
        width = batch.response_ids.shape[1]
        texts = tokenizer.batch_decode(ro.response_ids, skip_special_tokens=True)
        scores = torch.tensor(
            [
                combine_components(addition_components(t, chunk[i].answer), WEIGHTS)
                for t, i in zip(texts, ro.prompt_index, strict=True)
            ]
        )
        values = compute_values(critic, batch, batching=64) if use_critic else None
        adv = compute_advantage_stage(
            scores,
            StepTensors(batch.response_mask, values=values, group_id=torch.tensor(ro.prompt_index)),
            settings=advantage_settings(estimator),
            kl_coef=0.0,
        )
        if use_critic:
            update_critic(
                critic,
                critic_opt,
                batch,
                values=values,
                returns=adv.returns,
                settings=critic_settings(
                    ppo_epochs=critic_epochs or ppo_epochs,
                    mini_batch_size=(critic_mini_batch_prompts or mini_batch_prompts) * n,
                    micro_batch_size=micro_batch_size,
                ),
                seed=0,
            )
            critic_sched.step()
        update_actor(
            actor,
            actor_opt,
            batch,
            old_log_probs=pad_rows(ro.old_log_probs, width),
            advantages=adv.advantages,
            ref_log_probs=None,
            settings=actor_settings(
                ppo_epochs=ppo_epochs,
                mini_batch_size=mini_batch_prompts * n,
                micro_batch_size=micro_batch_size,
            ),
            seed=0,
        )
        actor_sched.step()
        accuracies.append(greedy_accuracy(actor, tokenizer, val))
    return accuracies
