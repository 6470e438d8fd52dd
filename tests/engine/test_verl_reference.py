"""ppoflow's math equals verl 0.9.1's own, case by case: the vectors in tests/engine/verl_reference/
were computed by verl's registered functions as its trainer calls them (scripts/verl_reference_vectors.py;
the README there says how). Each case is recomputed here with ppoflow's engine, from settings built
the way the run plan builds them, and compared: within 1e-10 in float64 and 1e-6 in float32, both
relative to max(1, |verl's value|) (values of order 1 compare absolutely).

Departures from verl, checked where they apply: advantages and returns are 0 at masked positions
(verl leaves whatever its arithmetic gives there); a group whose scores are all equal gets exactly 0
from every estimator that centres by its group (the cases' equal groups score 0.75, which verl's mean
also gives exactly, so they compare equal too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ppoflow.conf.schema_algorithm import RolloutCorrectionConfig
from ppoflow.engine.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageSpec, compute_advantages
from ppoflow.engine.kl import apply_kl_penalty, kl_penalty
from ppoflow.engine.masking import Aggregation, agg_loss
from ppoflow.engine.policy_losses import (
    POLICY_LOSSES,
    BypassSettings,
    ClipSettings,
    PolicyLossSpec,
    PolicyTokens,
    compute_policy_loss,
)
from ppoflow.engine.rollout_correction import rollout_correction
from ppoflow.tasks.pipeline.algorithm_settings import filled, rollout_correction_settings

REFERENCE = Path(__file__).parent / "verl_reference"
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOLERANCE = {"float64": 1e-10, "float32": 1e-6}
CENTRED = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg")
"""Estimators that give an all-equal group exactly 0 (ppoflow's departure)."""


def cases(name: str) -> list[dict]:
    data = json.loads((REFERENCE / f"{name}.json").read_text())
    assert data["verl_version"] == "0.9.1"
    return data["cases"]


def ids(items: list[dict]) -> list[str]:
    return [case["id"] for case in items]


def tensor(values, dtype: str | torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype)


def close(ours, theirs, dtype: str, what: str, scale: float = 1.0) -> None:
    """|ours − theirs| ≤ tolerance · scale · max(1, |theirs|), elementwise."""
    ours = torch.as_tensor(ours, dtype=torch.float64)
    theirs = torch.as_tensor(theirs, dtype=torch.float64)
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    bound = TOLERANCE[dtype] * scale * theirs.abs().clamp(min=1.0)
    worst = ((ours - theirs).abs() - bound).max() if ours.numel() else torch.tensor(-1.0)
    assert worst <= 0, f"{what}: off by {(ours - theirs).abs().max().item():.3g}"


def close_metrics(ours: dict, theirs: dict, dtype: str) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        close(ours[name], value, dtype, name)


# policy losses


def loss_spec(case: dict) -> PolicyLossSpec:
    """The case's loss and settings, built from its config by name as the run plan builds them."""
    config = case["config"]
    values = {**config, **config["policy_loss"]}
    for side in ("clip_ratio_low", "clip_ratio_high"):  # as ActorConfig.effective_clip_ratio_*
        values[side] = config["clip_ratio"] if config[side] is None else config[side]
    if case["loss_mode"] != "bypass_mode":
        return PolicyLossSpec(case["loss_mode"], filled(POLICY_LOSSES[case["loss_mode"]].settings, values))
    section = dict(config["policy_loss"]["rollout_correction"])
    loss_type = section.pop("loss_type")
    correction = rollout_correction_settings(RolloutCorrectionConfig(**section, bypass_mode=True))
    return PolicyLossSpec("bypass_mode", BypassSettings(loss_type, filled(ClipSettings, values), correction))


def aggregation(case: dict) -> Aggregation:
    info = case["config"]["global_batch_info"] or {}
    return Aggregation(
        case["loss_agg_mode"],
        tokens=info.get("batch_num_tokens"),
        rows=info.get("global_batch_size"),
        loss_scale_factor=info.get("loss_scale_factor"),
    )


@pytest.mark.parametrize("case", cases("policy_losses"), ids=ids(cases("policy_losses")))
def test_every_policy_loss_its_gradient_and_metrics_equal_verl(case):
    dtype, inputs = case["dtype"], case["inputs"]
    log_probs = tensor(inputs["log_prob"], dtype).requires_grad_(True)
    weights = inputs["rollout_is_weights"]
    tokens = PolicyTokens(
        tensor(inputs["old_log_prob"], dtype),
        log_probs,
        tensor(inputs["advantages"], dtype),
        torch.tensor(inputs["response_mask"], dtype=torch.bool),
        None if weights is None or case["loss_mode"] == "bypass_mode" else tensor(weights, dtype),
        torch.Generator().manual_seed(case["case_seed"]),
    )
    loss, metrics = compute_policy_loss(loss_spec(case), tokens, aggregation(case))
    loss.backward()
    expected = case["outputs"]
    assert str(loss.dtype).removeprefix("torch.") == expected["loss_dtype"]
    close(loss.item(), expected["loss"], dtype, "loss")
    close(log_probs.grad, expected["grad_log_prob"], dtype, "gradient")
    close_metrics(metrics, expected["metrics"], dtype)


# advantage estimators


def estimator_spec(case: dict) -> AdvantageSpec:
    kwargs = case["inputs"]["kwargs"]
    values = {
        **kwargs,
        "gdpo_reward_keys": tuple(kwargs["gdpo_reward_keys"] or ()),
        "gdpo_reward_weights": tuple(kwargs["gdpo_reward_weights"])
        if kwargs["gdpo_reward_weights"]
        else None,
    }
    settings_type = ADVANTAGE_ESTIMATORS[case["estimator"]].settings
    return AdvantageSpec(case["estimator"], filled(settings_type, values))


ESTIMATOR_CASES = [
    c
    for c in cases("advantage_estimators")
    if "error" not in c["outputs"] and "batch_keys" not in c["inputs"]
]
"""(The v1 trainer's multi-trajectory GRPO, one row per turn of an agent session, has no ppoflow
counterpart: ppoflow keeps a multi-turn response in one row, its tool tokens masked, the layout of
verl's tool agent loop, which every other case here uses.)"""


@pytest.mark.parametrize("case", ESTIMATOR_CASES, ids=ids(ESTIMATOR_CASES))
def test_every_estimator_equals_verl(case):
    dtype, inputs = case["dtype"], case["inputs"]
    mask = torch.tensor(inputs["response_mask"])
    rewards = tensor(inputs["token_level_rewards"], dtype)
    kl = inputs["kl_in_reward"]
    if kl is not None:  # the in-reward KL penalty that made these rewards, as verl's apply_kl_penalty
        scores = tensor(inputs["token_level_scores"], dtype)
        old, ref = tensor(inputs["old_log_probs"], dtype), tensor(inputs["ref_log_prob"], dtype)
        ours, current = apply_kl_penalty(scores, old, ref, mask, kl_coef=kl["kl_coef"], kind=kl["kl_penalty"])
        close(ours[mask != 0], rewards[mask != 0], dtype, "token_level_rewards")
        close(current, case["outputs"]["kl_metrics"]["actor/reward_kl_penalty"], dtype, "current_kl")

    def optional(name):
        return None if inputs.get(name) is None else tensor(inputs[name], dtype)

    gdpo = inputs.get("gdpo")
    advantages, returns = compute_advantages(
        estimator_spec(case),
        AdvantageInputs(
            rewards,
            mask,
            group_id=torch.tensor(inputs["index"]),
            values=optional("values"),
            reward_baselines=optional("reward_baselines"),
            old_log_probs=optional("old_log_probs"),
            sum_pi_squared=optional("sum_pi_squared"),
            rollout_is_weights=optional("rollout_is_weights"),
            reward_components={k: torch.tensor(v) for k, v in gdpo["components"].items()} if gdpo else None,
        ),
    )
    valid = mask != 0
    expected = case["outputs"]
    assert str(advantages.dtype).removeprefix("torch.") == expected["advantages_dtype"]
    close(advantages[valid], tensor(expected["advantages"], dtype)[valid], dtype, "advantages")
    close(returns[valid], tensor(expected["returns"], dtype)[valid], dtype, "returns")
    assert not advantages[~valid].any() and not returns[~valid].any()
    if case["estimator"] in CENTRED:
        scores = rewards.sum(dim=-1)
        for group in set(inputs["index"]):
            rows = [i for i, g in enumerate(inputs["index"]) if g == group]
            if len(rows) > 1 and len(set(scores[rows].tolist())) == 1:
                assert not advantages[rows].any(), f"group {group} scores alike but is not 0"


def test_grpo_passk_refuses_a_group_of_one_as_verl_does():
    [case] = [c for c in cases("advantage_estimators") if "error" in c["outputs"]]
    inputs = case["inputs"]
    with pytest.raises(ValueError, match="at least 2 responses"):
        compute_advantages(
            estimator_spec(case),
            AdvantageInputs(
                tensor(inputs["token_level_rewards"], case["dtype"]),
                torch.tensor(inputs["response_mask"]),
                group_id=torch.tensor(inputs["index"]),
            ),
        )
    assert "at least 2 samples per group" in case["outputs"]["error"]


# rollout correction


@pytest.mark.parametrize("case", cases("rollout_correction"), ids=ids(cases("rollout_correction")))
def test_rollout_correction_weights_rejection_and_metrics_equal_verl(case):
    dtype, inputs = case["dtype"], case["inputs"]
    mask = torch.tensor(inputs["response_mask"])
    old = tensor(inputs["old_log_prob"], dtype)
    rollout = None if inputs["rollout_log_prob"] is None else tensor(inputs["rollout_log_prob"], dtype)
    expected = case["outputs"]
    if case["function"] == "compute_offpolicy_metrics":
        from ppoflow.engine.rollout_correction import off_policy_metrics

        close_metrics(off_policy_metrics(old, rollout, mask), expected["metrics"], dtype)
        return
    settings = rollout_correction_settings(RolloutCorrectionConfig(**inputs["kwargs"]))
    correction = rollout_correction(old, rollout, mask, settings)
    close_metrics(correction.metrics, expected["metrics"], dtype)
    assert torch.equal(correction.response_mask, torch.tensor(expected["response_mask"]))
    if expected["rollout_is_weights"] is None:
        assert correction.weights is None
    else:
        close(correction.weights, expected["rollout_is_weights"], dtype, "weights")


# KL estimators and aggregation


KL_CASES = [c for c in cases("kl_and_agg") if c["function"] == "kl_penalty" and "error" not in c["outputs"]]
AGG_CASES = [c for c in cases("kl_and_agg") if c["function"] == "agg_loss" and "error" not in c["outputs"]]
"""(verl's agg_loss raises when dp_size > 1 comes without the global counts; ppoflow's Aggregation
has no dp_size: each rank's loss is its share of the mini-batch counts, and the stepper scales it by
the world size, engine/parallel.py. Those cases have nothing to compare.)"""


@pytest.mark.parametrize("case", KL_CASES, ids=ids(KL_CASES))
def test_kl_penalty_value_and_gradient_equal_verl(case):
    dtype = case["dtype"]
    log_probs = tensor(case["inputs"]["logprob"], dtype).requires_grad_(True)
    value = kl_penalty(log_probs, tensor(case["inputs"]["ref_logprob"], dtype), case["kl_penalty"])
    value.sum().backward()
    close(value.detach(), case["outputs"]["value"], dtype, "value")
    close(log_probs.grad, case["outputs"]["grad_logprob"], dtype, "gradient")


@pytest.mark.parametrize("case", AGG_CASES, ids=ids(AGG_CASES))
def test_agg_loss_value_and_gradient_equal_verl(case):
    dtype, inputs, kwargs = case["dtype"], case["inputs"], case["inputs"]["kwargs"]
    loss_mat = tensor(inputs["loss_mat"], dtype).requires_grad_(True)
    mask = torch.tensor(inputs["loss_mask"])
    agg = Aggregation(
        case["loss_agg_mode"],
        tokens=kwargs.get("batch_num_tokens"),
        rows=kwargs.get("global_batch_size"),
        loss_scale_factor=kwargs.get("loss_scale_factor"),
    )
    loss = agg_loss(loss_mat, mask, agg) * kwargs.get("dp_size", 1)
    loss.backward()
    # verl divides each row by its tokens + 1e-8; with the boolean and integer masks its trainer
    # passes that sum is float32, where the 1e-8 vanishes; a float64 mask keeps it (1e-9 relative)
    scale = 100.0 if inputs["loss_mask_dtype"] == "float64" and dtype == "float64" else 1.0
    close(loss.item(), case["outputs"]["loss"], dtype, "loss", scale)
    close(loss_mat.grad, case["outputs"]["grad_loss_mat"], dtype, "gradient", scale)


def test_every_name_in_verls_registries_is_ppoflows_and_loads():
    """The loss modes and estimators verl 0.9.1 registers (those its reference cases were made with:
    12 and 14) are exactly ppoflow's, and a config naming any of them loads without a refusal."""
    from ppoflow.conf import load_config

    losses = {case["loss_mode"] for case in cases("policy_losses")}
    estimators = {case["estimator"] for case in cases("advantage_estimators")}
    assert len(losses) == 12 and losses == set(POLICY_LOSSES)
    assert len(estimators) == 14 and estimators == set(ADVANTAGE_ESTIMATORS)
    needs = {
        "dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
        "bypass_mode": ["algorithm.rollout_correction.bypass_mode=true"],
        "gdpo": ["algorithm.gdpo_reward_keys=[correctness,format]"],
    }
    for mode in losses:
        cfg = load_config(
            None, [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *needs.get(mode, [])]
        )
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == mode
    for name in estimators:
        group = ["actor_rollout_ref.rollout.n=4"]  # what a group baseline needs, as verl's recipes set
        cfg = load_config(None, [f"algorithm.adv_estimator={name}", *group, *needs.get(name, [])])
        assert cfg.algorithm.adv_estimator == name
