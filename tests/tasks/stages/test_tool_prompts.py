"""Multi-turn prompts as verl renders them: a chat prompt gets the tools' schemas through the chat
template's `tools` (a tool-aware template lists them), ingest measures the same text rollout
renders, and a template that ignores tools renders as without them."""

from __future__ import annotations

from ppoflow.engine.tiny import build_tiny_tokenizer
from ppoflow.tasks.stages.prompt_rows import prompt_token_ids, render_prompts, rendered_prompt

TOOL_AWARE = (
    "{% if tools %}tools:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
SCHEMA = {"type": "function", "function": {"name": "calculator"}}
ROW = {"prompt_id": "p", "prompt_messages": [{"role": "user", "content": "1 + 2 ="}], "prompt_text": None}


def tokenizer(template: str):
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    return tok


def test_a_tool_aware_template_lists_the_tools_in_the_prompt():
    tok = tokenizer(TOOL_AWARE)
    with_tools = rendered_prompt(tok, ROW, (SCHEMA,))
    assert with_tools == "tools:calculator;user: 1 + 2 =\nassistant: "  # jinja's trim_blocks
    assert rendered_prompt(tok, ROW) == "user: 1 + 2 =\nassistant: "
    ((_, ids),) = render_prompts(tok, [ROW], 64, "error", (SCHEMA,))
    assert ids == prompt_token_ids(tok, ROW, (SCHEMA,)) and len(ids) > len(prompt_token_ids(tok, ROW))


def test_text_prompts_and_templates_without_tools_are_unchanged():
    tok = tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert rendered_prompt(tok, ROW, (SCHEMA,)) == rendered_prompt(tok, ROW) == "1 + 2 ="
    text_row = {"prompt_id": "q", "prompt_messages": None, "prompt_text": "3 + 4 = "}
    assert rendered_prompt(tok, text_row, (SCHEMA,)) == "3 + 4 = "
