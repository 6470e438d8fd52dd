"""`ppoflow show`: responses of one iteration with their rewards, and per token the log-probs, KL,
value, advantage and return — the seed's rollout record, readable in a terminal."""

from __future__ import annotations

import random
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ppoflow.tasks.storage.catalog import checked_dir
from ppoflow.tasks.storage.confined_query import query, views_of
from ppoflow.tasks.storage.step_files import step_folders, step_sql

SHOWN_PROMPT_CHARS = 300
"""A prompt is shown by its end (where the question is), cut to this many characters."""
ROWS_SQL = """
SELECT r.prompt_id, r.sample_idx, r.prompt_text, r.response_text, r.response_ids, r.old_log_probs,
       r.ref_log_probs, r.finish_reason, w.score, w.components, w.error, a."values", a.advantages,
       a.returns, a.kl
FROM {rollouts} r JOIN {rewards} w USING (iter, prompt_id, sample_idx)
                  JOIN {advantages} a USING (iter, prompt_id, sample_idx)
ORDER BY r.prompt_id, r.sample_idx
"""
SHOWN_TABLES = ("rollouts", "rewards", "advantages")


def pick(rows: list[dict], mode: str, count: int, seed: int) -> list[dict]:
    """best / worst by score (ties in table order), or a seeded random sample."""
    match mode:
        case "best":
            return sorted(rows, key=lambda r: -r["score"])[:count]
        case "worst":
            return sorted(rows, key=lambda r: r["score"])[:count]
        case "random":
            return random.Random(seed).sample(rows, min(count, len(rows)))
        case _:
            raise ValueError(f"unknown selection {mode!r}: expected best, worst or random")


TURNS_SQL = """
SELECT prompt_id, sample_idx, turn, call_index, role, text, turn_end, tool_name, arguments, result, error
FROM {turns} ORDER BY prompt_id, sample_idx, turn, call_index
"""


def load_rows(run_dir: Path, iteration: int | None) -> tuple[int, list[dict]]:
    """The rows of `iteration`, by default the newest with advantages (a step still running has
    its rollouts before them); a multi-turn run's rows with their `turns` and `response_mask`. Only
    that step's folder is read: a step of a long run shows as fast as one of a short run."""
    run = checked_dir(run_dir)
    views_of(run)  # not a run: said here
    sources = _newest_scored(run) if iteration is None else _scored(run, int(iteration))
    if sources is None:
        if iteration is None:
            raise ValueError(f"{run_dir} has no scored rollouts yet")
        scored = [step for step, _ in step_folders(run) if step_sql(run, "advantages", step)]
        have = f"iterations {scored[0]}–{scored[-1]} have them" if scored else "none has yet"
        raise ValueError(f"{run_dir} has no rollouts for iteration {iteration} ({have})")
    iteration, tables = sources
    rollout_columns = {
        c for (c, *_) in query(run, f"DESCRIBE SELECT * FROM {tables['rollouts']}", views=())[1]
    }
    sql = ROWS_SQL.format(**tables)
    if "response_mask" in rollout_columns:
        sql = sql.replace("SELECT r.prompt_id,", "SELECT r.response_mask, r.prompt_id,")
    columns, rows = query(run, sql, views=())
    found = [dict(zip(columns, row, strict=True)) for row in rows]
    turns_table = step_sql(run, "turns", iteration)
    if turns_table is not None and any(row.get("response_mask") is not None for row in found):
        names, turns = query(run, TURNS_SQL.format(turns=turns_table), views=())
        by_row: dict[tuple, list[dict]] = {}
        for turn in turns:
            record = dict(zip(names, turn, strict=True))
            by_row.setdefault((record["prompt_id"], record["sample_idx"]), []).append(record)
        for row in found:
            row["turns"] = by_row.get((row["prompt_id"], row["sample_idx"]), [])
    return iteration, found


def _scored(run: Path, step: int) -> tuple[int, dict[str, str]] | None:
    """(step, a FROM item of each shown table's rows of the step), when it has all three."""
    tables = {table: step_sql(run, table, step) for table in SHOWN_TABLES}
    if any(source is None for source in tables.values()):
        return None
    return step, {table: source for table, source in tables.items() if source is not None}


def _newest_scored(run: Path) -> tuple[int, dict[str, str]] | None:
    for step, _ in reversed(step_folders(run)):
        if (found := _scored(run, step)) is not None:
            return found
    return None


def run_tokenizer(run_dir: Path):
    """The tokenizer saved with the run's newest actor checkpoint (a LoRA checkpoint's base model's)
    or its copied base model."""
    from ppoflow.engine.models import load_tokenizer
    from ppoflow.tasks.storage.checkpoints import adapter_record
    from ppoflow.tasks.storage.tables import saved_folders

    saved = saved_folders(run_dir / "checkpoints", "actor") or [run_dir / "model/base"]
    directory = saved[-1]
    try:
        record = adapter_record(directory)
    except (OSError, ValueError):
        return None
    if record is not None:
        directory = run_dir / str(record["base"].get("checkpoint"))
    return load_tokenizer(directory) if (directory / "config.json").is_file() else None


def token_table(row: dict, tokens: list[str]) -> Table:
    mask = row.get("response_mask")
    columns = ["t", "token", *(["from"] if mask is not None else []), "old logp", "ref logp", "kl", "value"]
    table = Table(*columns, "adv", "return", box=None, pad_edge=False)
    for t, token in enumerate(tokens):
        source = [] if mask is None else [Text("model") if mask[t] else Text("tool", style="dim")]
        table.add_row(
            str(t),
            Text(repr(token)[1:-1]),
            *source,
            _num(row["old_log_probs"], t),
            _num(row["ref_log_probs"], t),
            _num(row["kl"], t),
            _num(row["values"], t),
            _num(row["advantages"], t),
            _num(row["returns"], t),
        )
    return table


def turn_line(turn: dict) -> Text:
    """One turn of a multi-turn response: an assistant turn's text and how it ended, or one tool
    call with its arguments and result (or error)."""
    if turn["role"] == "assistant":
        return Text.assemble(
            (f"turn {turn['turn']} assistant", "bold"),
            f" {turn['text']!r}",
            (f"  [{turn['turn_end']}]", "dim"),
        )
    name = turn["tool_name"] or "(malformed call)"
    outcome = (f" error: {turn['error']}", "red") if turn["error"] else (f" → {turn['result']!r}", "")
    return Text.assemble((f"turn {turn['turn']} tool", "bold"), f" {name} {turn['arguments']}", outcome)


def _num(values: list[float] | None, t: int) -> str:
    return "—" if values is None else f"{values[t]:+.3f}"


def render(console: Console, iteration: int, rows: list[dict], tokenizer) -> None:
    """Each row's prompt, response and per-token table. Every value is data, printed as written:
    a prompt such as `[INST] … [/INST]` is no rich markup."""
    for row in rows:
        components = ", ".join(f"{k} {v:g}" for k, v in dict(row["components"] or []).items())
        console.rule(
            Text(
                f"iter {iteration} · {row['prompt_id']} #{row['sample_idx']} · score {row['score']:.3f}"
                + (f" ({components})" if components else "")
                + f" · {row['finish_reason']}"
            )
        )
        prompt = row["prompt_text"]
        shown = prompt if len(prompt) <= SHOWN_PROMPT_CHARS else "…" + prompt[-SHOWN_PROMPT_CHARS:]
        console.print(Text.assemble(("prompt", "dim"), f"   {shown}"), soft_wrap=True)
        console.print(Text.assemble(("response", "dim"), f" {row['response_text']}"), soft_wrap=True)
        if row["error"]:
            console.print(Text.assemble(("reward error", "red"), f" {row['error']}"))
        for turn in row.get("turns", []):
            console.print(turn_line(turn), soft_wrap=True)
        ids = row["response_ids"]
        tokens = [tokenizer.decode([i]) for i in ids] if tokenizer else [str(i) for i in ids]
        console.print(token_table(row, tokens))
