"""The checks of `ppoflow diagnose` on multi-turn runs (rollout.multi_turn): tool calls that fail, and
responses that a turn limit or the response length stops inside the conversation. They read the turns
table's statistics (diagnose.py's ROW_STATS) and find nothing in a single-turn run."""

from __future__ import annotations

from ppoflow.tasks.observe.diagnose_run import Finding, RunData, evidence_of

MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"
TOOL_ERRORS_HIGH = 0.2
"""Share of tool calls that fail (malformed, unknown tool, bad arguments, exception, timeout) above
which the tool feedback is mostly error messages (the calculator task: ≤ 2% after its first steps)."""
CUT_HIGH = 0.1
"""Share of responses a turn limit or the length ends inside the conversation (calls made that the
model never read) above which the limits cut the task short."""


def check_tool_errors(run: RunData) -> list[Finding]:
    rates = run.series("turns/tool_error_rate")
    hot = [(i, v) for i, v in rates if v > TOOL_ERRORS_HIGH]
    if not hot:
        return []
    title = f"up to {max(v for _, v in hot):.0%} of tool calls failed, in iteration(s) {[i for i, _ in hot]}"
    causes = (
        "the model does not write the hermes call format yet (malformed: not JSON, an unclosed "
        "<tool_call>): `ppoflow query` the turns table's error column",
        "it calls tools by names or arguments the tool config does not have (describe the tools in "
        "the prompt)",
        "a tool raises or times out (turns.error says which)",
    )
    keys = {
        f"{MULTI_TURN}.tool_config_path": "the tools the prompts describe",
        f"{MULTI_TURN}.tool_timeout_s": "raise it if the errors are timeouts",
    }
    evidence = (evidence_of("turns/tool_error_rate", rates),)
    return [Finding("tool_errors", "warning", title, evidence, causes, run.advise(keys))]


def check_conversations_cut(run: RunData) -> list[Finding]:
    limits, unread = run.series("turns/turn_limit_rate"), run.series("turns/unread_tool_turn_rate")
    cut = {i: v for i, v in limits} | {i: max(v, dict(limits).get(i, 0.0)) for i, v in unread}
    hot = sorted((i, v) for i, v in cut.items() if v > CUT_HIGH)
    if not hot:
        return []
    title = (
        f"up to {max(v for _, v in hot):.0%} of responses end inside the conversation (a turn limit, "
        f"or a tool result that no longer fits), in iteration(s) {[i for i, _ in hot]}"
    )
    causes = (
        "multi_turn.max_assistant_turns / max_user_turns stop the model before its answer",
        "long tool results fill the response: the result is read only if it fits",
        "the model keeps calling tools instead of answering",
    )
    keys = {
        f"{MULTI_TURN}.max_assistant_turns": "raise it",
        f"{MULTI_TURN}.max_user_turns": "raise it",
        f"{MULTI_TURN}.max_tool_response_length": "lower it",
        "data.max_response_length": "raise it",
    }
    evidence = (
        evidence_of("turns/turn_limit_rate", limits),
        evidence_of("turns/unread_tool_turn_rate", unread),
    )
    return [Finding("conversations_cut", "warning", title, evidence, causes, run.advise(keys))]
