"""The checks of `ppoflow diagnose` on what the rollouts earn: reward signal, GRPO group spread,
the critic's fit to the returns, response length and truncation, and validation against the training
reward. Conventions (thresholds, healthy numbers) as in diagnose_checks.
"""

from __future__ import annotations

import math
import statistics

from ppoflow.tasks.observe.diagnose_run import (
    LR,
    Finding,
    RunData,
    Severity,
    evidence_of,
    fitted_change,
    values_of,
)

REWARD_STD_EPS = 1e-6
"""Scores whose standard deviation within an iteration is below this are one value: no signal."""
RETURN_VAR_MIN = 1e-4
"""explained variance is 1 − Var(R−V)/(Var(R)+1e-5): with Var(R) below 10× that epsilon it measures
the epsilon, not the critic (the seed's −200k explained variance)."""
EV_NEGATIVE = -0.1
"""critic/vf_explained_var below this in every recent iteration: the critic predicts worse than the
mean return. Healthy tiny runs start near 0, dip to −0.07 at most and rise to ~0.2; a single
iteration can fall to −0.13, hence a window."""
EV_WINDOW = 3
"""Recent iterations the explained variance must stay negative over (fewer when the run is shorter)."""
VF_LOSS_BLOWUP = 10.0
"""critic/vf_loss growing by this factor over the run is a diverging critic, not a slow one."""
LENGTH_COLLAPSE_FRACTION = 0.5
"""response_length/mean below this fraction of its first value: responses are being cut short (often
down to an immediate EOS)."""
TRUNCATION_HIGH = 0.1
"""Share of responses stopped by max_response_length above which the limit cuts real answers
(healthy tiny runs: ≤ 2%)."""
REWARD_RISE = 0.05
"""A fitted rise of training reward by this fraction of the reward range counts as rising (or, while
validation falls beyond its noise, a rise beyond the training reward's own noise)."""
VAL_FLAT = 0.01
"""A fitted validation change within ± this fraction of the validation score's range counts as flat."""
NOISE_SIGMAS = 2.0
"""A change counts only beyond this many standard errors of a mean (about 5% two-sided for one
estimate). A healthy 3-step run on 100 validation prompts (standard error ≈ 0.045 per iteration)
wobbles 0.64 → 0.577 (fitted −0.057): that is noise, not a fall."""
TREND_MIN_POINTS = 3
"""Training-reward points a trend needs before it is read."""
VAL_MIN_POINTS = 4
"""Validation points (before training included) the trend needs: with three, one noisy evaluation
decides its sign."""
ZERO_SPREAD_HIGH = 0.5
"""Share of GRPO groups whose responses all score the same (advantage 0) above which most of the batch
teaches nothing."""
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
"""Estimators whose baseline is the prompt's group: a group without spread gives them no gradient."""


def check_reward_signal(run: RunData) -> list[Finding]:
    std = run.series("rewards/score_std")
    flat = {i for i, v in std if v < REWARD_STD_EPS}
    if not flat:
        return []
    means = [(i, v) for i, v in run.series("rewards/score_mean") if i in flat]
    values = " / ".join(f"{v:g}" for v in sorted({float(f"{v:.6g}") for _, v in means}))
    where = "every iteration" if len(flat) == len(std) else f"iteration(s) {sorted(flat)}"
    evidence = [evidence_of("rewards/score_std", std), evidence_of("rewards/score_mean", means)]
    causes = [
        "the reward function gives every response the same value (look at a few with `ppoflow show`)",
        "every response is equally wrong or right: the task is too hard or too easy for the model",
        "reward errors scored as 0 (reward/error_rate)",
    ]
    ev = [(i, v) for i, v in run.series("critic/vf_explained_var") if i in flat]
    if ev:
        evidence.append(evidence_of("critic/vf_explained_var", ev))
        causes.append(
            "critic/vf_explained_var is meaningless here: the returns have no variance, so "
            "1 − Var(R−V)/(Var(R)+1e-5) measures the epsilon, not the critic"
        )
    keys = {"custom_reward_function.path": "a reward that separates good from bad responses"}
    weights = run.setting("reward.weights") or {}
    if weights and not any(weights.values()):  # only then is a weight the cause
        keys["reward.weights"] = "weights that are not all zero"
    severity: Severity = "critical" if len(flat) == len(std) else "warning"
    title = f"no reward signal: every response scores {values} in {where}"
    return [Finding("reward_constant", severity, title, tuple(evidence), tuple(causes), run.advise(keys))]


def check_critic_fit(run: RunData) -> list[Finding]:
    ev = run.series("critic/vf_explained_var")
    spread = dict(run.series("advantages/returns_var"))
    # ev[0] measures the critic before its first update; a return without variance says nothing.
    recent = [(i, v) for i, v in ev[1:] if spread.get(i, math.inf) >= RETURN_VAR_MIN][-EV_WINDOW:]
    if len(recent) < 2 or any(v >= EV_NEGATIVE for _, v in recent):
        return []
    loss = run.series("critic/vf_loss")
    # the peak, not the last value: a diverging critic's loss swings, and one spike is enough
    growth = max(v for _, v in loss[1:]) / loss[0][1] if len(loss) > 1 and loss[0][1] > 0 else 1.0
    diverging = growth >= VF_LOSS_BLOWUP
    title = (
        f"the critic does not fit the returns: explained variance < {EV_NEGATIVE:g} in iterations "
        f"{[i for i, _ in recent]} while the returns vary"
        + (f"; vf_loss grew up to ×{growth:.3g}" if diverging else "")
    )
    if diverging:
        causes: tuple[str, ...] = ("critic.optim.lr too large: vf_loss grows instead of falling",)
        keys = {"critic.optim.lr": "lower it ×10", "critic.cliprange_value": "0.2-0.5"}
    else:
        causes = (
            "critic.optim.lr too small or too few critic steps",
            "a fresh value head that needs warm-up",
        )
        keys = {"critic.optim.lr": "raise it ×3", "trainer.critic_warmup": "a few critic-only iterations"}
    evidence = (
        evidence_of("critic/vf_explained_var", ev),
        evidence_of("critic/vf_loss", loss),
        evidence_of("advantages/returns_var", sorted(spread.items())),
    )
    severity: Severity = "critical" if diverging else "warning"
    return [Finding("critic_not_fitting", severity, title, evidence, causes, run.advise(keys))]


def check_response_length(run: RunData) -> list[Finding]:
    length, empty = run.series("response_length/mean"), run.series("rollouts/empty")
    if len(length) < 2 or length[-1][1] >= LENGTH_COLLAPSE_FRACTION * length[0][1]:
        return []
    title = f"responses collapsed from {length[0][1]:.3g} to {length[-1][1]:.3g} tokens on average" + (
        f" ({empty[-1][1]:.0%} empty)" if empty and empty[-1][1] > 0 else ""
    )
    causes = (
        "the policy learned to stop at once (an immediate EOS) after a too-large update",
        "the reward favours short answers",
    )
    keys = {LR: "lower it", "reward.weights": "do not reward brevity alone"}
    evidence = (evidence_of("response_length/mean", length), evidence_of("rollouts/empty", empty))
    return [Finding("response_length_collapse", "warning", title, evidence, causes, run.advise(keys))]


def check_truncation(run: RunData) -> list[Finding]:
    cut = run.series("rollouts/truncated")
    hot = [(i, v) for i, v in cut if v > TRUNCATION_HIGH]
    if not hot:
        return []
    title = (
        f"up to {max(v for _, v in hot):.0%} of responses stop at max_response_length "
        f"({run.setting('data.max_response_length', '?')} tokens), in iteration(s) {[i for i, _ in hot]}"
    )
    causes = (
        "max_response_length too small for complete answers",
        "the model does not emit EOS (rambling)",
        "lengths growing because the reward favours long answers",
    )
    evidence = (
        evidence_of("rollouts/truncated", cut),
        evidence_of("response_length/clip_ratio", run.series("response_length/clip_ratio")),
    )
    keys = {"data.max_response_length": "raise it"}
    return [Finding("response_truncation", "warning", title, evidence, causes, run.advise(keys))]


def typical_sem(run: RunData, name: str) -> float:
    """The median per-iteration standard error of a mean score (0 when the rows give none: a single
    prompt per iteration, or hand-built data)."""
    sems = values_of(run.series(name))
    return statistics.median(sems) if sems else 0.0


def check_validation_vs_reward(run: RunData) -> list[Finding]:
    """Training reward rising while validation falls or stays flat, each beyond its sampling noise:
    validation must fall by more than NOISE_SIGMAS standard errors (or stay within the flat band),
    and the gap between the two trends must widen by more than NOISE_SIGMAS of their joint standard
    error. With a flat validation that asks the training rise alone to exceed it; with a validation
    fall beyond noise, a training rise the size of its own noise suffices (the gap is the finding).

    Each series is read on its own scale: the training reward's range (a reward model's scores span
    several units) and the validation score's (validation is rule-scored: about 0 to 1). Rising
    means REWARD_RISE of the training range, or, while validation falls beyond its noise, a rise
    beyond NOISE_SIGMAS of the training reward's own standard error."""
    val, train = run.series("validation/score_mean"), run.series("critic/score/mean")
    if len(val) < VAL_MIN_POINTS or len(train) < TREND_MIN_POINTS:
        return []
    scale = max([*values_of(run.series("rewards/score_range")), 1e-9])
    val_ranges = values_of(run.series("validation/score_range"))
    val_scale = max([*val_ranges, 1e-9]) if val_ranges else scale
    rise, val_change = fitted_change(train), fitted_change(val)
    train_se, val_se = typical_sem(run, "rewards/score_sem"), typical_sem(run, "validation/score_sem")
    falls = val_change < -max(NOISE_SIGMAS * val_se, VAL_FLAT * val_scale)
    flat = abs(val_change) <= VAL_FLAT * val_scale
    rising = REWARD_RISE * scale
    if falls and train_se:
        rising = min(rising, NOISE_SIGMAS * train_se)
    gap, gap_noise = rise - val_change, NOISE_SIGMAS * math.hypot(train_se, val_se)
    if rise < rising or not (falls or flat) or gap <= gap_noise:
        return []

    def noise(se: float) -> str:
        return f", standard error {se:.2g}" if se else ""

    title = (
        f"training reward rises (fitted {rise:+.3g}{noise(train_se)}) while validation "
        f"{'falls' if falls else 'stays flat'} (fitted {val_change:+.3g}{noise(val_se)})"
        + (f": the gap widens by {gap:.3g}, beyond {NOISE_SIGMAS:g}× its noise" if gap_noise else "")
    )
    causes = (
        "overfitting: too few distinct training prompts, or too many steps per batch",
        "reward hacking: the training reward pays for something validation does not",
        "sampling (temperature 1) and greedy validation diverge",
    )
    capped = run.setting("data.train_max_samples", -1) not in (-1, None)
    keys = {
        "data.train_max_samples" if capped else "data.train_files": (
            "raise it, or -1 for every prompt" if capped else "more distinct prompts"
        ),
        LR: "lower it",
    }
    if run.setting("reward_model.enable", False):  # a learned reward: the likeliest thing gamed
        keys["reward_model.model.path"] = "a reward model trained on more labelled answers"
        keys["reward.weights.rm_score"] = "a small weight beside the rule reward"
    else:
        keys["custom_reward_function.path"] = "check the reward cannot be gamed"
    evidence = tuple(
        evidence_of(name, run.series(name))
        for name in (
            "critic/score/mean",
            "rewards/score_sem",
            "validation/score_mean",
            "validation/score_sem",
        )
    )
    return [Finding("validation_diverges", "warning", title, evidence, causes, run.advise(keys))]


def check_group_spread(run: RunData) -> list[Finding]:
    n, estimator = int(run.setting("actor_rollout_ref.rollout.n", 1)), run.setting("algorithm.adv_estimator")
    zero = run.series("critic/score/zero_spread_group_ratio") or run.series("rewards/zero_spread_group_ratio")
    if n < 2 or estimator not in GROUP_ESTIMATORS or not zero:
        return []
    share, every = statistics.fmean(values_of(zero)), min(values_of(zero)) >= 1.0
    if share <= ZERO_SPREAD_HIGH:
        return []
    title = f"{share:.0%} of {estimator} groups (n={n}) score all their responses the same: advantage 0" + (
        ", no group carries a gradient" if every else ""
    )
    causes = (
        "prompts too easy or too hard for the model (all right or all wrong)",
        "a reward without partial credit",
        "too few samples per prompt",
        "sampling too cold",
    )
    keys = {
        "actor_rollout_ref.rollout.n": "more samples per prompt",
        "actor_rollout_ref.rollout.temperature": "1.0 or higher",
        "custom_reward_function.path": "partial credit",
    }
    evidence = (
        evidence_of("critic/score/zero_spread_group_ratio", zero),
        evidence_of("critic/score/group_std_mean", run.series("critic/score/group_std_mean")),
    )
    severity: Severity = "critical" if every else "warning"
    return [Finding("zero_spread_groups", severity, title, evidence, causes, run.advise(keys))]
