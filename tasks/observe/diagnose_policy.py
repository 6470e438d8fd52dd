"""The checks of `ppoflow diagnose` on the policy update: does the policy move, by how much per
step, whether the learning rate or the gradient is to blame, entropy, and KL to the reference.
Conventions (thresholds, healthy numbers) as in diagnose_checks.
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
    settings_evidence,
    values_of,
)

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
ENTROPY_COLLAPSE_FRACTION = 0.1
"""actor/entropy falling below this fraction of its first value: sampling has almost stopped exploring.
Healthy tiny runs halve it in 20 iterations (0.56 → 0.28) and reach 0.16 after 40."""
ENTROPY_DETERMINISTIC = 1e-3
"""Mean token entropy (nats) below this: every sample of a prompt is the same response."""
KL_REF_HIGH = 1.0
"""KL to the reference (actor/kl_loss, actor/reward_kl_penalty, nats/token) above this and still
rising: the KL term no longer holds the policy. A healthy tiny run with kl_coef 0.001 reaches ~0.3."""
KL_REF_CRITICAL = 5.0
"""5 nats/token: the reference gives the policy's tokens e^-5 < 1% of their probability."""


def optimizer_steps_per_iteration(run: RunData) -> int | None:
    """Actor optimizer steps per iteration: counted in actor_update's rows, else ppo_epochs ×
    ⌈train_batch_size / ppo_mini_batch_size⌉ from the config (both sizes in prompts, as in verl)."""
    counted = values_of(run.series("actor_update/steps"))
    if counted:
        return int(max(counted))
    batch = run.setting("data.train_batch_size")
    mini = run.setting("actor_rollout_ref.actor.ppo_mini_batch_size")
    epochs = run.setting("actor_rollout_ref.actor.ppo_epochs")
    return int(epochs) * math.ceil(int(batch) / int(mini)) if batch and mini and epochs else None


def _policy_still(run: RunData) -> bool:
    """ppo_kl and pg_clipfrac ≈ 0 in every iteration (an early jump followed by a saturated, still
    policy is entropy collapse, not this)."""
    kl, clip = values_of(run.series("actor/ppo_kl")), values_of(run.series("actor/pg_clipfrac"))
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
    evidence = (evidence_of("actor/ppo_kl", kl), evidence_of("actor/pg_clipfrac", clip))
    settings = (evidence_of("actor_update/steps", run.series("actor_update/steps")),)
    settings += settings_evidence(run, *BATCH_KEYS)
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
    if grad and max(values_of(grad)) < GRAD_PRESENT:
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
    evidence += (evidence_of("actor/grad_norm", grad),)
    return [Finding("policy_not_moving", "warning", title, evidence + settings, causes, run.advise(keys))]


def check_aggressive_updates(run: RunData) -> list[Finding]:
    kl, clip = run.series("actor/ppo_kl"), run.series("actor/pg_clipfrac")
    hot = sorted({i for i, v in kl if v > KL_HIGH} | {i for i, v in clip if v > CLIPFRAC_HIGH})
    if not hot:
        return []
    top_kl, top_clip = max(values_of(kl), default=0.0), max(values_of(clip), default=0.0)
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
    evidence = (evidence_of("actor/ppo_kl", kl), evidence_of("actor/pg_clipfrac", clip))
    return [Finding("aggressive_updates", severity, title, evidence, causes, run.advise(keys))]


def check_learning_rate(run: RunData) -> list[Finding]:
    """Whether the step size, rather than the gradient, is what is wrong."""
    grad, kl, lr = run.series("actor/grad_norm"), run.series("actor/ppo_kl"), run.series("actor/lr")
    if not grad or not kl:
        return []
    lr_text = f"lr {lr[-1][1]:.3g}" if lr else "the learning rate"
    evidence = (
        evidence_of("actor/lr", lr),
        evidence_of("actor/grad_norm", grad),
        evidence_of("actor/ppo_kl", kl),
    )
    median_grad = statistics.median(values_of(grad))
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
            "entropy_collapse",
            severity,
            title,
            (evidence_of("actor/entropy", ent),),
            causes,
            run.advise(keys),
        )
    ]


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
        evidence = (evidence_of(metric, kl),)
        findings.append(Finding("reference_kl_runaway", severity, title, evidence, causes, run.advise(keys)))
    return findings
