"""Multi-turn rollouts with tool calls (verl's tool agent loop, `rollout.multi_turn`).

A trajectory is the prompt followed by turns: the model generates until EOS or the length limit; when
that assistant turn calls tools (engine/tool_calls.py), the tools run and their results are appended
as one tool turn, and the model generates again, until it makes no call, a turn limit is reached or
the response would exceed `response_length` tokens. The response is every turn after the prompt;
`response_mask` is 1 on the tokens the model sampled and 0 on the tool turns' tokens, which the
policy never chose: log-probs, KL, entropy, values and losses count the model's tokens only (the
update and advantage stages honour the mask, ALGORITHMS.md).

All the batch's live trajectories generate each turn together (one `RolloutEngine.generate` call per
turn), so a multi-turn step costs as many generation calls as its longest trajectory has turns.
Turn k of response i samples from its own stream, derived from the response's seed and k (turn 0
from the seed itself), so a trajectory does not depend on its batch or on where it is generated.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from .names import FinishReason, ToolResponseTruncateSide
from .rollout import RolloutEngine, RolloutOutput, SamplingParams
from .tool_calls import MalformedCall, ToolCall, parse_tool_calls
from .tools import ToolContext, ToolResult, truncate_tool_text, utf8_text


@dataclass(frozen=True)
class MultiTurnLimits:
    """verl's multi_turn keys, as the loop reads them. `None` turn limits mean no limit."""

    response_length: int
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: ToolResponseTruncateSide = "middle"


class TurnCodec(Protocol):
    """The tokenizer's side of the loop."""

    def decode(self, ids: Sequence[int]) -> str:
        """An assistant turn's text, special tokens kept (tool-call tags may be special tokens)."""
        ...

    def tool_turn(self, results: Sequence[str]) -> list[int]:
        """The token ids of one tool turn that holds `results` (one per call), including whatever
        the chat template puts after it so the model's next turn starts right."""
        ...


class ToolRunner(Protocol):
    def run(self, calls: Sequence[ToolCall], context: ToolContext) -> list[tuple[ToolResult, float]]:
        """Each call's result and the seconds it took, in order. Never raises: an unknown tool, bad
        arguments, an exception or a timeout is a result with `error` set."""
        ...


TurnEnd = Literal["stop", "length", "tool_calls", "assistant_turn_limit", "user_turn_limit"]


@dataclass(frozen=True)
class TurnRecord:
    """One row of the `turns` table, before ids and text of the prompt are added: an assistant turn,
    or one tool call (all calls of a tool turn share its `turn` index and token span)."""

    turn: int
    role: Literal["assistant", "tool"]
    text: str
    token_start: int
    token_end: int
    seconds: float
    end: TurnEnd | None = None
    call_index: int | None = None
    tool_name: str | None = None
    arguments: str | None = None
    result: str | None = None
    error: str | None = None
    reward: float | None = None


@dataclass
class Trajectory:
    """One response's turns so far."""

    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    finish_reason: FinishReason | None = None

    @property
    def num_turns(self) -> int:
        """verl's num_turns: the prompt, each assistant turn and each tool turn."""
        return self.assistant_turns + self.user_turns + 1

    @property
    def tool_calls(self) -> int:
        return sum(t.role == "tool" for t in self.turns)


def turn_seed(seed: int, turn: int) -> int:
    """The random stream of turn `turn` of the response whose stream is `seed`."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/turn{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def run_multi_turn(
    engine: RolloutEngine,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    seeds: Sequence[int],
    contexts: Sequence[ToolContext],
    codec: TurnCodec,
    tools: ToolRunner,
    limits: MultiTurnLimits,
    on_tokens: Callable[[int], None] | None = None,
) -> list[Trajectory]:
    """One trajectory per prompt (repeat a prompt n times for n samples), trajectory i from the
    random stream `seeds[i]` with the tools' context `contexts[i]`."""
    if not len(prompt_ids) == len(seeds) == len(contexts):
        raise ValueError(f"{len(prompt_ids)} prompts, {len(seeds)} seeds, {len(contexts)} contexts")
    trajectories = [Trajectory() for _ in prompt_ids]
    live = list(range(len(prompt_ids)))
    turn = 0
    while live:
        budgets = [limits.response_length - len(trajectories[i].response_ids) for i in live]
        started = time.perf_counter()
        out = engine.generate(
            [list(prompt_ids[i]) + trajectories[i].response_ids for i in live],
            replace(params, max_new_tokens=max(budgets)),
            seeds=[turn_seed(seeds[i], turn) for i in live],
            on_tokens=on_tokens,
        )
        seconds = (time.perf_counter() - started) / len(live)
        calling = []
        for k, i in enumerate(live):
            ids, log_probs = out.response_ids[k][: budgets[k]], out.rollout_log_probs[k][: budgets[k]]
            finish = out.finish_reasons[k] if len(ids) == len(out.response_ids[k]) else "length"
            calls = _end_assistant_turn(trajectories[i], ids, log_probs, finish, turn, seconds, codec, limits)
            if calls:
                calling.append((i, calls))
        live = [
            i
            for i, calls in calling
            if _tool_turn(trajectories[i], calls, turn + 1, contexts[i], codec, tools, limits)
        ]
        turn += 2
    return trajectories


def _end_assistant_turn(
    trajectory: Trajectory,
    ids: list[int],
    log_probs: list[float],
    finish: FinishReason,
    turn: int,
    seconds: float,
    codec: TurnCodec,
    limits: MultiTurnLimits,
) -> list[ToolCall | MalformedCall]:
    """Append an assistant turn; the calls to run next ([] when the trajectory ends here)."""
    start = len(trajectory.response_ids)
    trajectory.response_ids += ids
    trajectory.response_mask += [1] * len(ids)
    trajectory.log_probs += log_probs
    trajectory.assistant_turns += 1
    text = codec.decode(ids)
    calls = parse_tool_calls(text) if finish == "stop" else []
    end: TurnEnd = "tool_calls" if calls else finish
    if finish == "length" or len(trajectory.response_ids) >= limits.response_length:
        end, calls = "length", []
    elif calls and limits.max_assistant_turns and trajectory.assistant_turns >= limits.max_assistant_turns:
        end, calls = "assistant_turn_limit", []
    elif calls and limits.max_user_turns and trajectory.user_turns >= limits.max_user_turns:
        end, calls = "user_turn_limit", []
    trajectory.turns.append(
        TurnRecord(turn, "assistant", text, start, len(trajectory.response_ids), seconds, end)
    )
    if not calls:
        trajectory.finish_reason = "length" if end == "length" else "stop"
    return calls


def _tool_turn(
    trajectory: Trajectory,
    calls: list[ToolCall | MalformedCall],
    turn: int,
    context: ToolContext,
    codec: TurnCodec,
    tools: ToolRunner,
    limits: MultiTurnLimits,
) -> bool:
    """Run the calls (at most max_parallel_calls, as verl) and append their results as one tool turn;
    whether the trajectory goes on (False: the turn would not fit in response_length, as in verl
    the trajectory then ends without it)."""
    calls = calls[: limits.max_parallel_calls]
    runnable = [c for c in calls if isinstance(c, ToolCall)]
    outcomes = iter(tools.run(runnable, context) if runnable else [])
    results: list[tuple[ToolResult, float]] = [
        _checked(next(outcomes)) if isinstance(c, ToolCall) else (_malformed(c), 0.0) for c in calls
    ]
    texts = [
        truncate_tool_text(r.text, limits.max_tool_response_length, limits.tool_response_truncate_side)
        for r, _ in results
    ]
    ids = codec.tool_turn(texts)
    start = len(trajectory.response_ids)
    fits = start + len(ids) < limits.response_length
    end = start + len(ids) if fits else start
    for index, (call, (result, seconds), text) in enumerate(zip(calls, results, texts, strict=True)):
        trajectory.turns.append(
            TurnRecord(
                turn,
                "tool",
                text if fits else "",
                start,
                end,
                seconds,
                call_index=index,
                tool_name=call.name if isinstance(call, ToolCall) else None,
                arguments=utf8_text(call.arguments_json if isinstance(call, ToolCall) else call.raw),
                result=result.text,
                error=result.error,
                reward=result.reward,
            )
        )
        if result.reward is not None:
            trajectory.tool_rewards.append(result.reward)
    if not fits:
        trajectory.finish_reason = "length"
        return False
    trajectory.response_ids += ids
    trajectory.response_mask += [0] * len(ids)
    trajectory.log_probs += [0.0] * len(ids)
    trajectory.user_turns += 1
    return True


def _malformed(call: MalformedCall) -> ToolResult:
    return ToolResult(f"Error when executing tool: malformed call: {call.message}", error=call.message)


def _checked(outcome: tuple[ToolResult, float]) -> tuple[ToolResult, float]:
    """A tool's result with its texts as UTF-8 can hold them (a lone surrogate escaped)."""
    result, seconds = outcome
    error = None if result.error is None else utf8_text(result.error)
    return ToolResult(utf8_text(result.text), result.reward, error), seconds


def rollout_output(trajectories: list[Trajectory]) -> RolloutOutput:
    """The trajectories as a rollout engine's output (responses, log-probs 0 at tool tokens, finish
    reasons), the trajectories kept beside them."""
    return RolloutOutput(
        [t.response_ids for t in trajectories],
        [t.log_probs for t in trajectories],
        [t.finish_reason or "stop" for t in trajectories],
        trajectories,
    )
