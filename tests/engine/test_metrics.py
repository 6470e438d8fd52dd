import math

import pytest
import torch

from ppoflow.engine.metrics import (
    compute_data_metrics,
    compute_group_metrics,
    compute_rollout_probs_diff,
    compute_throughput_metrics,
    compute_timing_metrics,
    memory_metrics,
    reduce_update_steps,
)

NAN = math.nan
# Row 0: full (3 tokens); row 1: padded after 2 tokens; row 2: empty. NaN at masked positions must not leak.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def data_metrics(**overrides):
    inputs = {
        "scores": t([1.0, 0.0, 0.5]),
        "token_level_rewards": t([[0, 0, 1], [0, -0.5, NAN], [NAN, NAN, NAN]]),
        "advantages": t([[1, 2, 3], [-1, -2, NAN], [NAN, NAN, NAN]]),
        "returns": t([[1, 1, 1], [0, 0, NAN], [NAN, NAN, NAN]]),
        "response_mask": MASK,
        "prompt_lengths": torch.tensor([4, 2, 4]),
        "max_prompt_length": 4,
        "max_response_length": 3,
    }
    return compute_data_metrics(**(inputs | overrides))


def test_data_metrics_hand_computed():
    values = t([[0.5, 0.5, 1], [0, 0.5, NAN], [NAN, NAN, NAN]])
    metrics = data_metrics(values=values)
    expected = {
        # the empty row (aborted, verl) is left out of score and rewards: scores [1, 0]
        "critic/score/mean": 0.5,
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
        # sums over valid tokens [1, -0.5]
        "critic/rewards/mean": 0.25,
        "critic/rewards/max": 1.0,
        "critic/rewards/min": -0.5,
        # valid tokens [1, 2, 3, -1, -2]
        "critic/advantages/mean": 0.6,
        "critic/advantages/max": 3.0,
        "critic/advantages/min": -2.0,
        # valid tokens [1, 1, 1, 0, 0]
        "critic/returns/mean": 0.6,
        "critic/returns/max": 1.0,
        "critic/returns/min": 0.0,
        # valid tokens [0.5, 0.5, 1, 0, 0.5]
        "critic/values/mean": 0.5,
        "critic/values/max": 1.0,
        "critic/values/min": 0.0,
        # Var(R) = 1.2 / 4 = 0.3; R − V = [0.5, 0.5, 0, 0, −0.5], Var = 0.7 / 4 = 0.175
        "critic/vf_explained_var": 1 - 0.175 / (0.3 + 1e-5),
        # lengths [3, 2, 0] with max 3
        "response_length/mean": 5 / 3,
        "response_length/max": 3.0,
        "response_length/min": 0.0,
        "response_length/clip_ratio": 1 / 3,
        # without the empty row: [3, 2]
        "response_length_non_aborted/mean": 2.5,
        "response_length_non_aborted/max": 3.0,
        "response_length_non_aborted/min": 2.0,
        "response_length_non_aborted/clip_ratio": 0.5,
        "response/aborted_ratio": 1 / 3,
        # lengths [4, 2, 4] with max 4
        "prompt_length/mean": 10 / 3,
        "prompt_length/max": 4.0,
        "prompt_length/min": 2.0,
        "prompt_length/clip_ratio": 2 / 3,
    }
    assert metrics.keys() == expected.keys()
    assert metrics == pytest.approx(expected)
    assert all(isinstance(value, float) for value in metrics.values())


def test_score_and_reward_stats_without_a_response_token_are_nan():
    metrics = data_metrics(response_mask=torch.zeros(3, 3))
    assert math.isnan(metrics["critic/score/mean"]) and math.isnan(metrics["critic/rewards/max"])
    assert metrics["response/aborted_ratio"] == 1.0
    assert math.isnan(metrics["response_length_non_aborted/clip_ratio"])


def test_data_metrics_without_critic_has_no_value_keys():
    metrics = data_metrics()
    assert not [key for key in metrics if key.startswith("critic/values") or key.endswith("explained_var")]
    assert metrics["critic/advantages/mean"] == pytest.approx(0.6)


def test_clip_ratios_count_rows_at_the_limit():
    metrics = data_metrics(max_response_length=2, max_prompt_length=5)
    assert metrics["response_length/clip_ratio"] == pytest.approx(1 / 3)  # only row 1 has exactly 2
    assert metrics["prompt_length/clip_ratio"] == 0.0
    assert data_metrics(response_mask=torch.ones(3, 3))["response_length/clip_ratio"] == 1.0


@pytest.mark.parametrize(
    ("returns", "values", "expected"),
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 1.0),  # perfect critic
        ([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], 1 - 1 / (1 + 1e-5)),  # Var(R − V) = Var(R) = 1
        ([1.0, 1.0, 1.0], [0.0, 1.0, 2.0], 1 - 1 / 1e-5),  # constant returns: the huge negative symptom
    ],
)
def test_explained_variance_hand_cases(returns, values, expected):
    padded = [t([returns + [NAN]]), t([values + [NAN]])]
    metrics = data_metrics(
        scores=t([0.0]),
        token_level_rewards=t([[0, 0, 0, 0]]),
        advantages=t([[0, 0, 0, 0]]),
        returns=padded[0],
        values=padded[1],
        response_mask=torch.tensor([[1, 1, 1, 0]]),
        prompt_lengths=torch.tensor([1]),
    )
    assert metrics["critic/vf_explained_var"] == pytest.approx(expected, rel=1e-6)


def test_group_metrics_hand_computed():
    scores = t([1, 0, 1, 1, 1, 1, 0])
    group_id = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    metrics = compute_group_metrics(scores, group_id)
    # groups 1 (all 1) and 2 (alone) have no spread
    assert metrics["critic/score/zero_spread_group_ratio"] == pytest.approx(2 / 3)
    # group 0: mean 2/3, Σ squared deviations 2/3, unbiased var 1/3; groups 1 and 2: std 0
    assert metrics["critic/score/group_std_mean"] == pytest.approx(math.sqrt(1 / 3) / 3)


def test_group_metrics_need_a_group_of_two():
    # one response per prompt (rollout.n = 1): every group would count as zero-spread, so nothing is logged
    assert compute_group_metrics(t([1, 0, 1]), torch.tensor([0, 1, 2])) == {}
    assert compute_group_metrics(t([]), torch.tensor([], dtype=torch.long)) == {}


def test_timing_per_token():
    metrics = compute_timing_metrics(
        {"gen": 2.0, "update_actor": 1.0, "step": 4.0}, {"gen": 1000, "update_actor": 4000, "step": 0}
    )
    assert metrics == pytest.approx(
        {
            "timing_s/gen": 2.0,
            "timing_s/update_actor": 1.0,
            "timing_s/step": 4.0,
            "timing_per_token_ms/gen": 2.0,
            "timing_per_token_ms/update_actor": 0.25,
        }
    )


def test_throughput():
    metrics = compute_throughput_metrics(total_tokens=12000, step_seconds=3.0, n_devices=4)
    assert metrics == {"perf/total_num_tokens": 12000.0, "perf/time_per_step": 3.0, "perf/throughput": 1000.0}
    with pytest.raises(ValueError, match="n_devices"):
        compute_throughput_metrics(total_tokens=1, step_seconds=1.0, n_devices=0)
    with pytest.raises(ValueError, match="step_seconds"):
        compute_throughput_metrics(total_tokens=1, step_seconds=0.0, n_devices=1)


def test_rollout_probs_diff_hand_computed():
    rollout = torch.log(t([[0.5, 0.2], [0.9, 0.3]]))
    old = torch.log(t([[0.4, 0.2], [0.6, 0.9]]))
    mask = torch.tensor([[1, 1], [1, 0]])  # the masked 0.6 gap must not count
    metrics = compute_rollout_probs_diff(rollout, old, mask)
    # diffs [0.1, 0, 0.3]: mean 2/15; squared deviations 1/900 + 16/900 + 25/900, unbiased var 21/900
    # Pearson of old [0.4, 0.2, 0.6] and rollout [0.5, 0.2, 0.9]: deviations [0, -0.2, 0.2] (Σ² 0.08)
    # and [-1, -10, 11] / 30 (Σ² 222/900), Σ products 0.14
    assert metrics == pytest.approx(
        {
            "training/rollout_probs_diff_valid": 1.0,
            "training/rollout_probs_diff_max": 0.3,
            "training/rollout_probs_diff_mean": 2 / 15,
            "training/rollout_probs_diff_std": math.sqrt(21 / 900),
            "training/rollout_actor_probs_pearson_corr": 0.14 / math.sqrt(0.08 * 222 / 900),
        }
    )


def test_rollout_probs_correlation_is_nan_when_undefined():
    lone = compute_rollout_probs_diff(t([[-1.0, 0.0]]), t([[-1.0, 0.0]]), torch.tensor([[1, 0]]))
    assert math.isnan(lone["training/rollout_actor_probs_pearson_corr"])
    constant = compute_rollout_probs_diff(t([[-1.0, -1.0]]), t([[-2.0, -1.0]]), torch.tensor([[1, 1]]))
    assert math.isnan(constant["training/rollout_actor_probs_pearson_corr"])


def test_memory_metrics_are_gib_of_this_process_and_host():
    metrics = memory_metrics()
    assert metrics.keys() == {
        "perf/max_memory_allocated_gb",
        "perf/max_memory_reserved_gb",
        "perf/cpu_memory_used_gb",
    }
    # on CPU both peaks are the process's peak RSS: at least what torch and this test hold (> 50 MiB)
    if not torch.cuda.is_initialized():
        assert metrics["perf/max_memory_allocated_gb"] == metrics["perf/max_memory_reserved_gb"] > 0.05
    with open("/proc/meminfo") as meminfo:
        total_gib = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1]) / 1024**2
    assert 0 < metrics["perf/cpu_memory_used_gb"] < total_gib


def test_reduce_update_steps_means_metrics_and_keeps_nan():
    steps = [
        {"actor/pg_loss": 1.0, "actor/grad_norm": 2.0, "critic/vf_loss": 5.0, "step": 0},
        {"actor/pg_loss": 3.0, "actor/grad_norm": NAN, "step": 1},
    ]
    metrics = reduce_update_steps(steps)
    assert metrics.keys() == {"actor/pg_loss", "actor/grad_norm", "critic/vf_loss"}
    assert metrics["actor/pg_loss"] == 2.0
    assert metrics["critic/vf_loss"] == 5.0  # averaged over the rows that hold it
    assert math.isnan(metrics["actor/grad_norm"])
