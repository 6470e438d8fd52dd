"""The `ppoflow` command line, as a user runs it (subprocesses)."""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[2]


def ppoflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ppoflow", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_the_commands():
    out = ppoflow("--help")
    assert out.returncode == 0
    for command in ("train", "query", "config", "schema"):
        assert command in out.stdout


def test_config_prints_the_effective_config_with_overrides():
    out = ppoflow("config", "actor_rollout_ref.actor.optim.lr=1e-5", "trainer.experiment_name=cli")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-5
    assert cfg["trainer"]["experiment_name"] == "cli"
    assert cfg["algorithm"]["adv_estimator"] == "gae"


def test_bad_override_is_one_clear_line_and_exit_code_2():
    out = ppoflow("train", "actor_rollout_ref.actor.optim.lrr=1e-5")
    assert out.returncode == 2
    assert "did you mean 'actor_rollout_ref.actor.optim.lr'" in out.stderr
    assert "Traceback" not in out.stderr


def test_query_prints_a_table_and_json(small_run):
    run_dir, _, _ = small_run
    sql = "SELECT iter, count(*) AS n FROM rollouts GROUP BY iter ORDER BY iter"
    out = ppoflow("query", str(run_dir), sql)
    assert out.returncode == 0, out.stderr
    assert "iter" in out.stdout and "32" in out.stdout and "(2 rows)" in out.stdout
    as_json = json.loads(ppoflow("query", str(run_dir), sql, "--format", "json").stdout)
    assert as_json == [{"iter": 1, "n": 32}, {"iter": 2, "n": 32}]


def test_query_errors_name_the_views(small_run):
    run_dir, _, _ = small_run
    out = ppoflow("query", str(run_dir), "SELECT * FROM rollout")
    assert out.returncode == 2
    assert "rollouts" in out.stderr and "Traceback" not in out.stderr


def test_output_piped_into_head_exits_141_without_a_traceback(small_run):
    """`ppoflow query … | head -1`: 200k rows overflow the pipe buffer, so the writes after head has
    gone fail; ppoflow exits 141 as a SIGPIPE-killed coreutils command would (seen with pipefail)."""
    run_dir, _, _ = small_run
    command = shlex.join(
        [
            sys.executable,
            "-m",
            "ppoflow",
            "query",
            str(run_dir),
            "SELECT * FROM range(200000)",
            "--format",
            "csv",
        ]
    )
    out = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command} | head -1"], capture_output=True, text=True, timeout=120
    )
    assert out.stdout == "range\n"
    assert out.returncode == 141 and out.stderr == "", out.stderr


def test_schema_documents_the_tables():
    listing = ppoflow("schema")
    assert "rollouts" in listing.stdout and "advantages" in listing.stdout
    rollouts = ppoflow("schema", "rollouts")
    assert "old_log_probs" in rollouts.stdout and "response_ids" in rollouts.stdout
    updates = ppoflow("schema", "updates")  # a view the README lists beside the tables
    assert updates.returncode == 0 and "the rows of actor_update and critic_update together" in updates.stdout
    assert "\nupdates " in listing.stdout
    unknown = ppoflow("schema", "nosuch")
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("ppoflow: unknown table 'nosuch'; tables: prompts, rejects, rollouts")


def test_show_counts_are_whole_numbers_of_at_least_one(tmp_path):
    refused = {"0": "0 is not at least 1", "-1": "-1 is not at least 1", "x": "'x' is not a whole number"}
    for value, why in refused.items():
        out = ppoflow("show", str(tmp_path), "--worst", value)
        assert out.returncode == 2 and f"argument --worst: {why}" in out.stderr


def test_show_prints_responses_with_rewards_and_per_token_values(small_run):
    run_dir, _, _ = small_run
    out = ppoflow("show", str(run_dir), "--best", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("iter 2 · ") == 2  # the last iteration by default
    for column in ("old logp", "value", "adv", "return"):
        assert column in out.stdout
    best = query_scores(run_dir)
    assert f"score {best[0]:.3f}" in out.stdout
    prompts = [line for line in out.stdout.splitlines() if line.startswith("prompt ")]
    assert len(prompts) == 2 and all(" = " in line and "…" not in line for line in prompts)  # not cut
    random_one = ppoflow("show", str(run_dir), "--iter", "1", "--random", "1", "--seed", "3")
    assert random_one.stdout.count("iter 1 · ") == 1
    missing = ppoflow("show", str(run_dir), "--iter", "9")
    assert (
        missing.returncode == 2 and "no rollouts for iteration 9 (iterations 1–2 have them)" in missing.stderr
    )


def test_show_prints_text_as_written_not_as_markup(small_run, tmp_path):
    """A Llama-2 chat prompt closes a tag that was never opened ([/INST]): rich markup would raise;
    a response with [red]…[/red] would lose its brackets."""
    run_dir = tmp_path / "run"
    shutil.copytree(small_run[0], run_dir)
    path = run_dir / "iter=000002/rollouts/part-00000.parquet"
    table = pq.read_table(path)
    prompts = pa.array(["<s>[INST] What is 3 + 9 = ? [/INST]"] * table.num_rows)
    responses = pa.array(["[red]12[/red] [link=http://x]y[/link]"] * table.num_rows)
    table = table.set_column(table.schema.get_field_index("prompt_text"), "prompt_text", prompts)
    table = table.set_column(table.schema.get_field_index("response_text"), "response_text", responses)
    pq.write_table(table, path)
    out = ppoflow("show", str(run_dir), "--best", "1")
    assert out.returncode == 0, out.stderr
    assert "[INST] What is 3 + 9 = ? [/INST]" in out.stdout
    assert "[red]12[/red] [link=http://x]y[/link]" in out.stdout


def test_query_prints_values_as_written_in_every_format(small_run):
    run_dir, _, _ = small_run
    sql = (
        "SELECT '[/INST] [red]x[/red]' AS \"[/a]\", NULL AS n, 'None' AS none_text, [1, NULL] AS l, "
        "map(['k'], ['nan'::DOUBLE]) AS m, 0.25::DECIMAL(4, 2) AS d, repeat('y', 90) AS long"
    )
    table = ppoflow("query", str(run_dir), sql)
    assert table.returncode == 0, table.stderr
    for shown in ("[/a]", "[/INST] [red]x[/red]", "NULL", "None", "[1, null]", '{"k": null}', "0.25"):
        assert shown in table.stdout, shown
    assert "y" * 79 + "…" in table.stdout and "(1 row; cells over 80 characters cut" in table.stdout
    as_json = json.loads(ppoflow("query", str(run_dir), sql, "--format", "json").stdout)
    assert as_json == [
        {"[/a]": "[/INST] [red]x[/red]", "n": None, "none_text": "None", "l": [1, None], "m": {"k": None},
         "d": 0.25, "long": "y" * 90}
    ]  # fmt: skip
    as_csv = list(csv.reader(io.StringIO(ppoflow("query", str(run_dir), sql, "--format", "csv").stdout)))
    assert as_csv == [
        ["[/a]", "n", "none_text", "l", "m", "d", "long"],
        ["[/INST] [red]x[/red]", "", "None", "[1, null]", '{"k": null}', "0.25", "y" * 90],
    ]
    many = ppoflow("query", str(run_dir), "SELECT * FROM range(10002)")
    assert many.stdout.rstrip().endswith(
        "(10,002 rows; the first 10,000 drawn: add LIMIT, or --format csv or json for all)"
    )


def query_scores(run_dir) -> list[float]:
    from ppoflow.tasks.storage.confined_query import query

    return [
        row[0] for row in query(run_dir, "SELECT score FROM rewards WHERE iter = 2 ORDER BY score DESC")[1]
    ]


def test_a_tool_that_cannot_be_built_is_refused_before_the_run_is_touched(tmp_path):
    """A tool file that fails to import was found when the flow ran, after the run directory had
    been made and an existing run's config rewritten; it is now refused first, in one line."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "broken.py").write_text("raise ImportError('no module named weather_api')\n")
    schema = "    tool_schema: {type: function, function: {name: weather}}\n"
    (tools / "tools.yaml").write_text("tools:\n  - class_name: broken.py:Weather\n" + schema)
    new, existing = tmp_path / "new", tmp_path / "existing"
    existing.mkdir()
    (existing / ".lock").touch()
    (existing / "config.yaml").write_text("# the config of this run's last start\n")
    for run in (new, existing):
        out = ppoflow(
            "train",
            "--config",
            str(ROOT / "conf/tool_calculator.yaml"),
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools / 'tools.yaml'}",
            f"trainer.default_local_dir={run}",
        )
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1
        assert "importing it failed: ImportError: no module named weather_api" in out.stderr
    assert not new.exists()
    assert sorted(p.name for p in existing.iterdir()) == [".lock", "config.yaml"]
    assert (existing / "config.yaml").read_text() == "# the config of this run's last start\n"


def test_a_quoted_tilde_in_a_path_is_the_home_folder(tmp_path):
    """`ppoflow query '~/x'` (quoted: the shell leaves `~` alone) looked for a folder named `~`."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("trainer:\n  val_only: false\n")
    out = subprocess.run(
        [sys.executable, "-m", "ppoflow", "query", "~/run", "SELECT 42 AS answer", "--format", "csv"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"HOME": str(tmp_path)},
        cwd=tmp_path.parent,
    )
    assert (out.returncode, out.stdout) == (0, "answer\n42\n"), out.stderr
