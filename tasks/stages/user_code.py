"""The user's code a run imports: its custom reward function and its tools, each checked once in a
worker of its own before the run directory is touched. Imports neither Prefect nor torch: `ppoflow
train` checks them before its temporary Prefect server starts (Prefect must not be imported before)."""

from __future__ import annotations

from ppoflow.tasks.models.tool_runner import check_tools
from ppoflow.tasks.pipeline.settings import RunPlan
from ppoflow.tasks.stages.reward_functions import check_custom_reward

__all__ = ["check_user_code"]


def check_user_code(plan: RunPlan) -> None:
    """Import the custom reward function and every user tool once, each in a worker as the stages
    will: a RewardFunctionError or ToolLoadError now, before the run directory is touched."""
    settings = plan.settings
    check_custom_reward(settings.reward.custom_function, settings.reward.timeout_s)
    if settings.rollout.multi_turn is not None:
        check_tools(settings.rollout.multi_turn.tools, settings.rollout.multi_turn.tool_timeout_s)
