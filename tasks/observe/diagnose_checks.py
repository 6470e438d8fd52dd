"""The checks of `ppoflow diagnose`, in the order they run: one small pure function per check over a
RunData, each returning Findings: severity, evidence (metric, iterations, values), likely causes, and
the verl config keys to change. diagnose_policy holds the checks on the policy update,
diagnose_rewards those on what the rollouts earn.

Thresholds are named constants beside their checks, with the reason they sit where they do.
"Healthy" numbers quoted there were measured on the embedded default (tiny model, single-digit
addition, 20 iterations); the rest follows the seed's reading of verl's metrics. The tiny model moves
more per step than a large one, so the limits sit where a healthy tiny run stays clear of them.
"""

from __future__ import annotations

from collections.abc import Callable

from ppoflow.tasks.observe.diagnose_policy import (
    check_aggressive_updates,
    check_entropy,
    check_learning_rate,
    check_policy_not_moving,
    check_reference_kl,
)
from ppoflow.tasks.observe.diagnose_rewards import (
    check_critic_fit,
    check_group_spread,
    check_response_length,
    check_reward_signal,
    check_truncation,
    check_validation_vs_reward,
)
from ppoflow.tasks.observe.diagnose_run import Finding, RunData
from ppoflow.tasks.observe.diagnose_tools import check_conversations_cut, check_tool_errors

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
    check_tool_errors,
    check_conversations_cut,
)
