"""The transformers engine on CUDA computes what it computes on the CPU (marked `gpu`: skipped
without a CUDA device). float32 on both, TF32 off (torch's default for matrix products): the
differences are rounding of other kernels, bounded here by stated tolerances."""

from __future__ import annotations

import copy

import pytest
import torch

from ppoflow.engine.forward import compute_log_probs, compute_values
from ppoflow.engine.models import load_actor, load_critic, load_tokenizer
from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.engine.rollout import HFRolloutEngine, SamplingParams, sample_seed
from ppoflow.engine.tiny import all_addition_problems
from ppoflow.engine.update import update_actor, update_critic

from ..engine.settings import actor_settings, critic_settings

pytestmark = pytest.mark.gpu

LOG_PROB_TOLERANCE = 1e-4  # absolute, per token
PARAMETER_TOLERANCE = 1e-5  # absolute, per weight, after one SGD step of lr 0.1


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    return tokenizer, [tokenizer(p.prompt)["input_ids"] for p in all_addition_problems()[:64]]


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_generation_on_cuda_matches_the_cpu(tiny_model_dir, prompts, do_sample):
    """The random streams live on the CPU, so a response does not depend on the device: the same
    tokens, and log-probs within rounding. A token whose probability rounds across a draw (or a
    greedy near-tie) may differ on one device, so up to 2 of the 64 responses may take another path
    from there; every other response is the same, token for token."""
    tokenizer, prompt_ids = prompts
    params = SamplingParams(max_new_tokens=6, temperature=1.0, do_sample=do_sample)
    seeds = [sample_seed(7, i, 0) for i in range(len(prompt_ids))]
    outputs = {}
    for device in ("cpu", "cuda"):
        model = load_actor(tiny_model_dir).to(device)
        assert next(model.parameters()).device.type == device  # the engine generates where its model is
        engine = HFRolloutEngine(
            model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
        )
        outputs[device] = engine.generate(prompt_ids, params, seeds=seeds)
    cpu, cuda = outputs["cpu"], outputs["cuda"]
    same = [i for i, ids in enumerate(cpu.response_ids) if cuda.response_ids[i] == ids]
    assert len(same) >= len(prompt_ids) - 2, f"{len(prompt_ids) - len(same)} responses differ"
    for i in same:
        cpu_row, cuda_row = torch.tensor(cpu.rollout_log_probs[i]), torch.tensor(cuda.rollout_log_probs[i])
        assert torch.allclose(cuda_row, cpu_row, atol=LOG_PROB_TOLERANCE), i


def _batch(tiny_model_dir, prompts):
    tokenizer, prompt_ids = prompts
    model = load_actor(tiny_model_dir)
    engine = HFRolloutEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    seeds = [sample_seed(3, i, 0) for i in range(len(prompt_ids))]
    out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=6), seeds=seeds)
    return build_sequence_batch(prompt_ids, out.response_ids, pad_token_id=tokenizer.pad_token_id)


def test_log_probs_and_values_on_cuda_match_the_cpu(tiny_model_dir, prompts):
    batch = _batch(tiny_model_dir, prompts)
    actor, critic = load_actor(tiny_model_dir), load_critic(tiny_model_dir)
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.score.weight, std=0.1)  # a head of zeros would make values trivially equal
    cpu_log_probs = compute_log_probs(actor, batch, temperature=0.7, batching=16)
    cpu_values = compute_values(critic, batch, batching=16)
    cuda_log_probs = compute_log_probs(actor.cuda(), batch, temperature=0.7, batching=16)
    cuda_values = compute_values(critic.cuda(), batch, batching=16)
    assert cuda_log_probs.device.type == "cpu"  # the engine hands results back on the CPU
    assert (cpu_log_probs != 0).sum() > 100
    assert torch.allclose(cuda_log_probs, cpu_log_probs, atol=LOG_PROB_TOLERANCE)
    assert torch.allclose(cuda_values, cpu_values, atol=1e-4)


def test_one_update_on_cuda_matches_the_cpu(tiny_model_dir, prompts):
    """One PPO actor step and one critic step: the weights after it agree. SGD, whose step is
    proportional to the gradient (Adam's first step is ±lr for any gradient, whose sign rounding can
    flip where the gradient is near 0)."""
    batch = _batch(tiny_model_dir, prompts)
    generator = torch.Generator().manual_seed(5)
    advantages = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    returns = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    actor_base, critic_base = load_actor(tiny_model_dir), load_critic(tiny_model_dir)
    old = compute_log_probs(actor_base, batch, temperature=1.0, batching=16)
    values = compute_values(critic_base, batch, batching=16)
    trained = {}
    for device in ("cpu", "cuda"):
        actor, critic = copy.deepcopy(actor_base).to(device), copy.deepcopy(critic_base).to(device)
        actor_metrics = update_actor(
            actor,
            torch.optim.SGD(actor.parameters(), lr=0.1),
            batch,
            old_log_probs=old,
            advantages=advantages,
            ref_log_probs=None,
            settings=actor_settings(ppo_epochs=1, mini_batch_size=len(batch), micro_batch_size=16),
            seed=0,
        ).mean_metrics()
        critic_metrics = update_critic(
            critic,
            torch.optim.SGD(critic.parameters(), lr=0.1),
            batch,
            values=values,
            returns=returns,
            settings=critic_settings(ppo_epochs=1, mini_batch_size=len(batch), micro_batch_size=16),
            seed=0,
        ).mean_metrics()
        trained[device] = (actor.cpu(), critic.cpu(), actor_metrics | critic_metrics)
    (cpu_actor, cpu_critic, cpu_metrics), (cuda_actor, cuda_critic, cuda_metrics) = (
        trained["cpu"],
        trained["cuda"],
    )
    for name in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert cuda_metrics[name] == pytest.approx(cpu_metrics[name], rel=1e-4, abs=1e-6), name
    for cpu_model, cuda_model, base in (
        (cpu_actor, cuda_actor, actor_base),
        (cpu_critic, cuda_critic, critic_base),
    ):
        moved, gap = _largest_change(cpu_model, base), _largest_change(cuda_model, cpu_model)
        assert moved > 1e-4  # the step moved the weights: agreeing copies of an unchanged model prove nothing
        assert gap < PARAMETER_TOLERANCE, (gap, moved)


def _largest_change(model: torch.nn.Module, other: torch.nn.Module) -> float:
    pairs = zip(model.parameters(), other.parameters(), strict=True)
    return max((a.detach() - b.detach()).abs().max().item() for a, b in pairs)
