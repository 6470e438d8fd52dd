"""A tokenizer's side of multi-turn rollouts (engine/multi_turn.py's `TurnCodec`).

With a chat template, a tool turn is the template applied to the turn's `tool` messages alone, with
the generation prompt after it and without the system prompt the template puts before a first
message (verl's `apply_chat_template(..., remove_system_prompt=True)`). Without one (the built-in tiny
model), a tool turn is the hermes tags around each result: `<tool_response>…</tool_response>`.
"""

from __future__ import annotations

from collections.abc import Sequence

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


class TokenizerTurnCodec:
    def __init__(self, tokenizer, *, chat: bool):
        """`chat`: the prompts are chat messages rendered with the tokenizer's template."""
        self.tokenizer = tokenizer
        self.chat = chat and getattr(tokenizer, "chat_template", None) is not None
        self._system = self._system_prompt() if self.chat else ""

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def tool_turn(self, results: Sequence[str]) -> list[int]:
        return list(self.tokenizer(self.tool_turn_text(results), add_special_tokens=False)["input_ids"])

    def tool_turn_text(self, results: Sequence[str]) -> str:
        if not self.chat:
            return "".join(f"{RESPONSE_OPEN}{text}{RESPONSE_CLOSE}" for text in results)
        messages = [{"role": "tool", "content": text} for text in results]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text[len(self._system) :] if self._system and text.startswith(self._system) else text

    def _system_prompt(self) -> str:
        """The text a template puts before the first message when there is no system message (verl's
        `initialize_system_prompt`, on text): what one empty user message renders to, less what a
        second one adds."""
        render = self.tokenizer.apply_chat_template
        one = render([{"role": "user", "content": ""}], add_generation_prompt=False, tokenize=False)
        two = render([{"role": "user", "content": ""}] * 2, add_generation_prompt=False, tokenize=False)
        return one[: len(one) - (len(two) - len(one))]
