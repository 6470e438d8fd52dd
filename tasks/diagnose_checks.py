"""The checks of `ppoflow diagnose`, one small pure function per check over a RunData, each
returning Findings: severity, evidence (metric, iterations, values), likely causes, and the verl
config keys to change.

Thresholds are named constants with the reason they sit where they do. "Healthy" numbers quoted
below were measured on the embedded default (tiny model, single-digit addition, 20 iterations); the
rest follows the seed's reading of verl's metrics. The tiny model moves more per step than a large
one, so the limits sit where a healthy tiny run stays clear of them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from .diagnose_run import Evidence, Finding, RunData, Severity

KL_STILL = 1e-3
"""|actor/ppo_kl| below this is a policy that does not move: healthy tiny runs log 0.014-0.23, the
tiny model at lr 1e-6 logs ~1e-4."""
CLIPFRAC_STILL = 1e-3
"""actor/pg_clipfrac below this (the seed's "1e-4, basically 0") means no token left the clip range."""
CLIPFRAC_HIGH = 0.3
"""Above this share of clipped tokens updates are too aggressive (the seed: 0.05-0.3 is comfortable,
0.3-0.8 unstable). Healthy tiny runs peak at 0.12."""
KL_HIGH = 0.5
"""actor/ppo_kl (nats/token) above this is a step far outside the trust region: the 40 iterations of
the embedded default peak at 0.23 (with clipfrac 0.11); lr 3e-3 logs 0.5-1.8, lr 0.05 logs 8."""
KL_CRITICAL = 1.0
"""An update that moves the policy by more than a nat per token has replaced it, not refined it."""
GRAD_PRESENT = 1e-3
"""actor/grad_norm above this is a real gradient (a zero advantage gives exactly 0): if the policy
still does not move, the step size (lr) is what is missing."""
GRAD_EXPLODE = 10.0
"""grad_norm above this multiple of grad_clip is an exploding gradient, not a large step size."""
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
ENTROPY_COLLAPSE_FRACTION = 0.1
"""actor/entropy falling below this fraction of its first value: sampling has almost stopped exploring.
Healthy tiny runs halve it in 20 iterations (0.56 → 0.28) and reach 0.16 after 40."""
ENTROPY_DETERMINISTIC = 1e-3
"""Mean token entropy (nats) below this: every sample of a prompt is the same response."""
LENGTH_COLLAPSE_FRACTION = 0.5
"""response_length/mean below this fraction of its first value: responses are being cut short (often
down to an immediate EOS)."""
TRUNCATION_HIGH = 0.1
"""Share of responses stopped by max_response_length above which the limit cuts real answers
(healthy tiny runs: ≤ 2%)."""
KL_REF_HIGH = 1.0
"""KL to the reference (actor/kl_loss, actor/reward_kl_penalty, nats/token) above this and still
rising: the KL term no longer holds the policy. A healthy tiny run with kl_coef 0.001 reaches ~0.3."""
KL_REF_CRITICAL = 5.0
"""5 nats/token: the reference gives the policy's tokens e^-5 < 1% of their probability."""
REWARD_RISE = 0.05
"""A fitted rise of training reward by this fraction of the reward range counts as rising."""
VAL_FLAT = 0.01
"""A fitted validation change below this fraction of the reward range counts as flat or falling."""
TREND_MIN_POINTS = 3
"""Points a trend needs before it is read."""
ZERO_SPREAD_HIGH = 0.5
"""Share of GRPO groups whose responses all score the same (advantage 0) above which most of the batch
teaches nothing."""
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
"""Estimators whose baseline is the prompt's group: a group without spread gives them no gradient."""

LR = "actor_rollout_ref.actor.optim.lr"


def _values(points: list[tuple[int, float]]) -> list[float]:
    return [v for _, v in points]


def _evidence(metric: str, points: list[tuple[int, float]]) -> Evidence:
    return Evidence(metric, tuple(i for i, _ in points), tuple(float(f"{v:.6g}") + 0.0 for _, v in points))


def _setting_evidence(run: RunData, *keys: str) -> tuple[Evidence, ...]:
    return tuple(Evidence(k, (), (run.setting(k),)) for k in keys if run.setting(k) is not None)


def fitted_change(points: list[tuple[int, float]]) -> float:
    """Least-squares slope × span of the iterations: how much the series moved, robust to one noisy end."""
    if len(points) < 2:
        return 0.0
    xs, ys = [float(i) for i, _ in points], _values(points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope * (xs[-1] - xs[0])


def optimizer_steps_per_iteration(run: RunData) -> int | None:
    """Actor optimizer steps per iteration: counted in actor_update's rows, else ppo_epochs ×
    ⌈train_batch_size / ppo_mini_batch_size⌉ from the config (both sizes in prompts, as in verl)."""
    counted = _values(run.series("actor_update/steps"))
    if counted:
        return int(max(counted))
    batch = run.setting("data.train_batch_size")
    mini = run.setting("actor_rollout_ref.actor.ppo_mini_batch_size")
    epochs = run.setting("actor_rollout_ref.actor.ppo_epochs")
    return int(epochs) * math.ceil(int(batch) / int(mini)) if batch and mini and epochs else None


def _policy_still(run: RunData) -> bool:
    """ppo_kl and pg_clipfrac ≈ 0 in every iteration (an early jump followed by a saturated, still
    policy is entropy collapse, not this)."""
    kl, clip = _values(run.series("actor/ppo_kl")), _values(run.series("actor/pg_clipfrac"))
    return bool(kl and clip) and max(map(abs, kl)) < KL_STILL and max(clip) < CLIPFRAC_STILL


BATCH_KEYS = (
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.rollout.n",
)


def check_policy_not_moving(run: RunData) -> list[Finding]:
    if not _policy_still(run):
        return []
    kl, clip, grad = (run.series(m) for m in ("actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm"))
    evidence = (_evidence("actor/ppo_kl", kl), _evidence("actor/pg_clipfrac", clip))
    settings = (_evidence("actor_update/steps", run.series("actor_update/steps")),)
    settings += _setting_evidence(run, *BATCH_KEYS)
    if optimizer_steps_per_iteration(run) == 1:
        title = (
            "ppo_kl and pg_clipfrac are 0 as expected: with one mini-batch and one PPO epoch the only "
            "update step starts from the rollout policy (ratio = 1 when the metrics are taken), so they "
            "cannot show whether the policy moves: judge that by the reward and validation curves"
        )
        cause = (
            "train_batch_size == ppo_mini_batch_size and ppo_epochs == 1: one optimizer step per iteration"
        )
        keys = {
            "actor_rollout_ref.actor.ppo_mini_batch_size": "below data.train_batch_size for off-policy steps",
            "actor_rollout_ref.actor.ppo_epochs": "> 1 to reuse each batch",
        }
        return [Finding("policy_not_moving", "info", title, evidence + settings, (cause,), run.advise(keys))]
    if grad and max(_values(grad)) < GRAD_PRESENT:
        causes = (
            "actor/grad_norm is 0: every advantage is 0 (no reward signal, or GRPO groups without spread)",
        )
        keys = {"custom_reward_function.path": "a reward that varies between responses"}
    else:
        causes = (
            "the learning rate is too small for this model (see learning_rate)",
            "advantages are weak or the reward is sparse",
            "clip range or grad_clip too tight",
        )
        keys = {LR: "raise it ×10"}
    title = (
        f"the policy is not moving: |actor/ppo_kl| < {KL_STILL:g} and actor/pg_clipfrac < "
        f"{CLIPFRAC_STILL:g} in every iteration, although each takes several optimizer steps"
    )
    evidence += (_evidence("actor/grad_norm", grad),)
    return [Finding("policy_not_moving", "warning", title, evidence + settings, causes, run.advise(keys))]


def check_aggressive_updates(run: RunData) -> list[Finding]:
    kl, clip = run.series("actor/ppo_kl"), run.series("actor/pg_clipfrac")
    hot = sorted({i for i, v in kl if v > KL_HIGH} | {i for i, v in clip if v > CLIPFRAC_HIGH})
    if not hot:
        return []
    top_kl, top_clip = max(_values(kl), default=0.0), max(_values(clip), default=0.0)
    title = (
        f"updates are too aggressive in iteration(s) {hot}: ppo_kl up to {top_kl:.3g} (limit {KL_HIGH:g}), "
        f"pg_clipfrac up to {top_clip:.3g} (limit {CLIPFRAC_HIGH:g})"
    )
    causes = (
        "learning rate too large",
        "too many optimizer steps per batch (ppo_epochs × mini-batches)",
        "clip range too wide",
    )
    keys = {
        LR: "lower it ×3-10",
        "actor_rollout_ref.actor.ppo_epochs": "fewer epochs",
        "actor_rollout_ref.actor.ppo_mini_batch_size": "larger mini-batches",
        "actor_rollout_ref.actor.clip_ratio": "0.2 or less",
    }
    severity: Severity = "critical" if top_kl > KL_CRITICAL else "warning"
    evidence = (_evidence("actor/ppo_kl", kl), _evidence("actor/pg_clipfrac", clip))
    return [Finding("aggressive_updates", severity, title, evidence, causes, run.advise(keys))]


def check_learning_rate(run: RunData) -> list[Finding]:
    """Whether the step size, rather than the gradient, is what is wrong."""
    grad, kl, lr = run.series("actor/grad_norm"), run.series("actor/ppo_kl"), run.series("actor/lr")
    if not grad or not kl:
        return []
    lr_text = f"lr {lr[-1][1]:.3g}" if lr else "the learning rate"
    evidence = (_evidence("actor/lr", lr), _evidence("actor/grad_norm", grad), _evidence("actor/ppo_kl", kl))
    median_grad = statistics.median(_values(grad))
    if _policy_still(run) and optimizer_steps_per_iteration(run) != 1 and median_grad >= GRAD_PRESENT:
        title = (
            f"{lr_text} is too small for the observed grad norm (median {median_grad:.3g}): the gradient "
            "is there, the steps do not move the policy"
        )
        causes = (
            "Adam moves each parameter by ~lr whatever the gradient's size: this lr is too small a step",
        )
        keys = {LR: "raise it ×10, then watch ppo_kl and pg_clipfrac"}
        return [Finding("learning_rate", "warning", title, evidence, causes, run.advise(keys))]
    jumps = {i for i, v in kl if v > KL_HIGH}
    if not jumps:
        return []
    grad_clip = float(run.setting("actor_rollout_ref.actor.grad_clip", 1.0))
    at_jump = max((v for i, v in grad if i in jumps), default=0.0)
    if at_jump > GRAD_EXPLODE * grad_clip:
        title = (
            f"exploding gradient: actor/grad_norm {at_jump:.3g} > {GRAD_EXPLODE:g} × grad_clip "
            f"{grad_clip:g} where ppo_kl jumps"
        )
        causes = ("a few tokens with huge advantages or log-ratios", "rewards on a large scale")
        keys = {"actor_rollout_ref.actor.grad_clip": "1.0 or lower", LR: "lower it"}
        return [Finding("learning_rate", "warning", title, evidence, causes, run.advise(keys))]
    title = (
        f"{lr_text} is too large for the observed grad norm: ordinary gradients (≤ {at_jump:.3g}) move "
        f"the policy by ppo_kl > {KL_HIGH:g} in iteration(s) {sorted(jumps)}"
    )
    causes = (
        "the step size, not the gradient, makes the jump; a grad_norm that then falls to ~0 is a "
        "saturated (deterministic) policy",
    )
    return [Finding("learning_rate", "warning", title, evidence, causes, run.advise({LR: "lower it ×10"}))]


def check_reward_signal(run: RunData) -> list[Finding]:
    std = run.series("rewards/score_std")
    flat = {i for i, v in std if v < REWARD_STD_EPS}
    if not flat:
        return []
    means = [(i, v) for i, v in run.series("rewards/score_mean") if i in flat]
    values = " / ".join(f"{v:g}" for v in sorted({float(f"{v:.6g}") for _, v in means}))
    where = "every iteration" if len(flat) == len(std) else f"iteration(s) {sorted(flat)}"
    evidence = [_evidence("rewards/score_std", std), _evidence("rewards/score_mean", means)]
    causes = [
        "the reward function gives every response the same value (look at a few with `ppoflow show`)",
        "every response is equally wrong or right: the task is too hard or too easy for the model",
        "reward errors scored as 0 (reward/error_rate)",
    ]
    ev = [(i, v) for i, v in run.series("critic/vf_explained_var") if i in flat]
    if ev:
        evidence.append(_evidence("critic/vf_explained_var", ev))
        causes.append(
            "critic/vf_explained_var is meaningless here: the returns have no variance, so "
            "1 − Var(R−V)/(Var(R)+1e-5) measures the epsilon, not the critic"
        )
    keys = {
        "custom_reward_function.path": "a reward that separates good from bad responses",
        "reward.weights": "weights that are not all zero",
    }
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
    growth = loss[-1][1] / loss[0][1] if len(loss) > 1 and loss[0][1] > 0 else 1.0
    diverging = growth >= VF_LOSS_BLOWUP
    title = (
        f"the critic does not fit the returns: explained variance < {EV_NEGATIVE:g} in iterations "
        f"{[i for i, _ in recent]} while the returns vary"
        + (f"; vf_loss grew ×{growth:.3g}" if diverging else "")
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
        _evidence("critic/vf_explained_var", ev),
        _evidence("critic/vf_loss", loss),
        _evidence("advantages/returns_var", sorted(spread.items())),
    )
    severity: Severity = "critical" if diverging else "warning"
    return [Finding("critic_not_fitting", severity, title, evidence, causes, run.advise(keys))]


def check_entropy(run: RunData) -> list[Finding]:
    ent = run.series("actor/entropy")
    if len(ent) < 2 or ent[0][1] <= 0:
        return []
    first = ent[0][1]
    low_iter, low = min(ent[1:], key=lambda p: p[1])
    if low >= ENTROPY_COLLAPSE_FRACTION * first and low >= ENTROPY_DETERMINISTIC:
        return []
    title = (
        f"entropy collapsed from {first:.3g} to {low:.3g} nats/token (iteration {low_iter}): the policy "
        "has stopped exploring" + (", its samples are all the same" if low < ENTROPY_DETERMINISTIC else "")
    )
    causes = (
        "learning rate too large: a few steps make the policy deterministic",
        "no entropy bonus",
        "symmetric clip range: unlikely tokens cannot gain probability (DAPO's clip-higher)",
    )
    keys = {
        LR: "lower it",
        "actor_rollout_ref.actor.entropy_coeff": "a small bonus, e.g. 0.001",
        "actor_rollout_ref.actor.clip_ratio_high": "0.28 (clip-higher)",
        "actor_rollout_ref.rollout.temperature": "1.0 or higher",
    }
    severity: Severity = "critical" if low < ENTROPY_DETERMINISTIC else "warning"
    return [
        Finding(
            "entropy_collapse", severity, title, (_evidence("actor/entropy", ent),), causes, run.advise(keys)
        )
    ]


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
    evidence = (_evidence("response_length/mean", length), _evidence("rollouts/empty", empty))
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
        _evidence("rollouts/truncated", cut),
        _evidence("response_length/clip_ratio", run.series("response_length/clip_ratio")),
    )
    keys = {"data.max_response_length": "raise it"}
    return [Finding("response_truncation", "warning", title, evidence, causes, run.advise(keys))]


def check_reference_kl(run: RunData) -> list[Finding]:
    findings = []
    for metric, coef in (
        ("actor/kl_loss", "actor_rollout_ref.actor.kl_loss_coef"),
        ("actor/reward_kl_penalty", "algorithm.kl_ctrl.kl_coef"),
    ):
        kl = run.series(metric)
        if len(kl) < 2 or kl[-1][1] <= KL_REF_HIGH or fitted_change(kl) <= 0:
            continue
        title = f"KL to the reference is running away: {metric} reached {kl[-1][1]:.3g} nats/token, rising"
        causes = ("KL coefficient too small to hold the policy", "learning rate too large")
        keys = {coef: "raise it ×10", "algorithm.kl_ctrl.type": "adaptive", LR: "lower it"}
        severity: Severity = "critical" if kl[-1][1] > KL_REF_CRITICAL else "warning"
        evidence = (_evidence(metric, kl),)
        findings.append(Finding("reference_kl_runaway", severity, title, evidence, causes, run.advise(keys)))
    return findings


def check_validation_vs_reward(run: RunData) -> list[Finding]:
    val, train = run.series("validation/score_mean"), run.series("critic/score/mean")
    if len(val) < TREND_MIN_POINTS or len(train) < TREND_MIN_POINTS:
        return []
    scale = max([*_values(run.series("rewards/score_range")), 1e-9])
    rise, val_change = fitted_change(train), fitted_change(val)
    if rise < REWARD_RISE * scale or val_change > VAL_FLAT * scale:
        return []
    title = (
        f"training reward rises (fitted {rise:+.3g}) while validation "
        f"{'falls' if val_change < 0 else 'stays flat'} (fitted {val_change:+.3g})"
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
        "custom_reward_function.path": "check the reward cannot be gamed",
    }
    evidence = (_evidence("critic/score/mean", train), _evidence("validation/score_mean", val))
    return [Finding("validation_diverges", "warning", title, evidence, causes, run.advise(keys))]


def check_group_spread(run: RunData) -> list[Finding]:
    n, estimator = int(run.setting("actor_rollout_ref.rollout.n", 1)), run.setting("algorithm.adv_estimator")
    zero = run.series("critic/score/zero_spread_group_ratio") or run.series("rewards/zero_spread_group_ratio")
    if n < 2 or estimator not in GROUP_ESTIMATORS or not zero:
        return []
    share, every = statistics.fmean(_values(zero)), min(_values(zero)) >= 1.0
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
        _evidence("critic/score/zero_spread_group_ratio", zero),
        _evidence("critic/score/group_std_mean", run.series("critic/score/group_std_mean")),
    )
    severity: Severity = "critical" if every else "warning"
    return [Finding("zero_spread_groups", severity, title, evidence, causes, run.advise(keys))]


CHECKS: tuple[Callable[[RunData], list[Finding]], ...] = (
    check_policy_not_moving,
    check_aggressive_updates,
    check_learning_rate,
    check_reward_signal,
    check_critic_fit,
    check_entropy,
    check_response_length,
    check_truncation,
    check_reference_kl,
    check_validation_vs_reward,
    check_group_spread,
)
