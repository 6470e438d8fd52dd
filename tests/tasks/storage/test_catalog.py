"""The DuckDB catalog over a hand-made two-iteration run written through write_table."""

import json
import shutil
import subprocess
import sys
import textwrap

import duckdb
import pyarrow as pa
import pytest

from ppoflow.tasks.storage.catalog import (
    CATALOG_NAME,
    check_invariants,
    connect_readonly,
    refresh_catalog,
    refresh_catalog_if_stale,
    table_violations,
)
from ppoflow.tasks.storage.confined_query import query
from ppoflow.tasks.storage.schemas import SCHEMAS, TABLES, empty_table, metrics_table
from ppoflow.tasks.storage.tables import stage_path, write_table

KEYS = [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]


def rows(name: str, it: int) -> list[dict]:
    """A few valid rows of each table for iteration `it`; response k has 2 + sample_idx tokens."""
    n = {(p, s): 2 + s for p, s in KEYS}
    key = [{"prompt_id": p, "sample_idx": s} for p, s in KEYS]
    scored = {"ground_truth": "3", "score": 0.9, "components": {"correct": 1.0, "format": 1.0}, "error": None}
    match name:
        case "rollouts":
            return [
                {**k, "group_id": int(k["prompt_id"][1]), "data_source": "arith", "prompt_text": "1 + 2 = ",
                 "response_text": "3" * m, "prompt_ids": [1, 2, 3], "response_ids": list(range(m)),
                 "rollout_log_probs": [-0.5] * m, "old_log_probs": [-0.4] * m,
                 "ref_log_probs": [-0.6] * m if k["sample_idx"] == 0 else None, "prompt_length": 3,
                 "response_length": m, "finish_reason": ["stop", "length"][k["sample_idx"]],
                 "policy_version": it - 1, "seed": 100 * it + i}
                for i, (k, m) in enumerate(zip(key, n.values(), strict=True))
            ]  # fmt: skip
        case "rewards":
            return [{**k, "data_source": "arith", **scored} for k in key]
        case "advantages":
            return [
                {**k, "values": [0.1] * m, "token_level_rewards": [0.0] * (m - 1) + [0.9],
                 "advantages": [0.5] * m, "returns": [0.9] * m, "kl": None, "train_weight": 1}
                for k, m in zip(key, n.values(), strict=True)
            ]  # fmt: skip
        case "actor_update" | "critic_update":
            cols = [c for c in SCHEMAS[name].names if c not in ("epoch", "mini_batch", "other_metrics")]
            others = {"other_metrics": {"rollout_corr/kl": 0.01 * it}} if name == "actor_update" else {}
            values = dict.fromkeys(cols, 0.1 * it)
            return [{"epoch": 0, "mini_batch": b, **values, **others} for b in range(2)]
        case "validation":
            return [
                {**k, "data_source": "arith", "prompt_text": "1 + 2 = ", "response_text": "3",
                 "response_length": 2, "finish_reason": "stop", **scored}
                for k in key
            ]  # fmt: skip
        case "prompts":
            text = {"prompt_text": "1 + 2 = ", "prompt_messages": None}
            chat = {"prompt_text": None, "prompt_messages": [{"role": "user", "content": "1 + 2 ="}]}
            common = {"data_source": "arith", "ability": "math", "ground_truth": "3", "extra_info": "{}"}
            split = ["train", "val"][it]
            return [
                {"prompt_id": f"{split}-{i}", "split": split, "row_index": i, **common, **[text, chat][i]}
                for i in range(2)
            ]
    raise KeyError(name)


def table(name: str, it: int) -> pa.Table:
    return pa.Table.from_pylist(rows(name, it), schema=SCHEMAS[name])


STAGE_TABLES = {"rollouts": "rollouts", "rewards": "rewards", "advantages": "advantages"}
STAGE_TABLES |= {s: s for s in ("actor_update", "critic_update", "validation")}


def write_run(run_dir, iterations=(1, 2)):
    write_config(run_dir)
    write_table(table("prompts", 0), run_dir, "data/train.parquet", SCHEMAS["prompts"])
    write_table(table("prompts", 1), run_dir, "data/val.parquet", SCHEMAS["prompts"])
    for it in iterations:
        for stage, name in STAGE_TABLES.items():
            write_table(table(name, it), run_dir, stage_path(it, stage), SCHEMAS[name])
        metrics = metrics_table({"actor/pg_clipfrac": 0.1 * it, "critic/score/mean": 0.9}, step=it)
        write_table(metrics, run_dir, stage_path(it, "metrics"))


def write_config(run_dir):
    """The file that makes a folder a run directory for ppoflow's readers."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("trainer:\n  val_only: false\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("seed=3") / "run"  # a key=value folder must not leak into views
    write_run(run_dir)
    refresh_catalog(run_dir)
    return run_dir


def test_iter_is_an_integer_column_and_values_come_from_the_files(run):
    cols, result = query(run, "SELECT iter, count(*), min(seed) FROM rollouts GROUP BY iter ORDER BY iter")
    assert cols == ["iter", "count_star()", "min(seed)"]
    assert result == [(1, 4, 100), (2, 4, 200)]
    _, types = query(
        run, "SELECT column_name, column_type FROM (DESCRIBE rollouts) WHERE column_name = 'iter'"
    )
    assert types == [("iter", "INTEGER")]


def test_every_stage_is_a_view_with_both_iterations(run):
    for name in (
        "rollouts",
        "rewards",
        "advantages",
        "actor_update",
        "critic_update",
        "validation",
        "metrics",
    ):
        assert query(run, f"SELECT DISTINCT iter FROM {name} ORDER BY iter")[1] == [(1,), (2,)], name
    assert query(run, "SELECT split, count(*) FROM prompts GROUP BY split ORDER BY split")[1] == [
        ("train", 2),
        ("val", 2),
    ]


def test_list_and_map_columns_are_readable(run):
    sql = """SELECT response_ids, old_log_probs, ref_log_probs, len(response_ids) FROM rollouts
             WHERE iter = 2 AND prompt_id = 'p1' AND sample_idx = 1"""
    assert query(run, sql)[1] == [([0, 1, 2], [pytest.approx(-0.4)] * 3, None, 3)]
    assert query(run, "SELECT components['correct'] FROM rewards WHERE iter = 1 LIMIT 1")[1] == [(1.0,)]
    _, messages = query(run, "SELECT prompt_messages[1].role FROM prompts WHERE prompt_messages IS NOT NULL")
    assert messages == [("user",), ("user",)]


def test_updates_union_both_roles(run):
    cols, result = query(run, "SELECT role, iter, count(*) FROM updates GROUP BY ALL ORDER BY ALL")
    assert cols[0] == "role"
    assert result == [("actor", 1, 2), ("actor", 2, 2), ("critic", 1, 2), ("critic", 2, 2)]


def test_metrics_columns_keep_verl_names(run):
    cols, result = query(run, 'SELECT iter, step, "actor/pg_clipfrac" FROM metrics ORDER BY iter')
    assert result == [(1, 1, pytest.approx(0.1)), (2, 2, pytest.approx(0.2))]


def test_a_table_without_files_is_an_empty_view_with_declared_columns(run):
    cols, result = query(run, "SELECT * FROM rejects")
    assert (cols, result) == (SCHEMAS["rejects"].names, [])


def test_an_empty_run_has_every_view_typed_from_the_schema(tmp_path):
    write_config(tmp_path)
    write_table(table("prompts", 0), tmp_path, "data/train.parquet", SCHEMAS["prompts"])
    refresh_catalog(tmp_path)
    cols, result = query(tmp_path, "SELECT * FROM rollouts")
    assert (cols, result) == (["iter", *SCHEMAS["rollouts"].names], [])
    _, types = query(tmp_path, "SELECT column_name, column_type FROM (DESCRIBE rollouts)")
    assert dict(types)["response_ids"] == "INTEGER[]" and dict(types)["iter"] == "INTEGER"
    assert query(tmp_path, "SELECT * FROM metrics")[0] == ["iter", *empty_table("metrics").column_names]
    assert query(tmp_path, "SELECT role FROM updates")[1] == []
    assert query(tmp_path, "SELECT count(*) FROM prompts")[1] == [(2,)]
    assert check_invariants(tmp_path) == {}


def test_a_new_iteration_appears_without_a_refresh_once_the_view_exists(tmp_path):
    write_run(tmp_path, iterations=(1,))
    refresh_catalog(tmp_path)
    write_run(tmp_path, iterations=(2,))
    assert query(tmp_path, "SELECT max(iter) FROM rewards")[1] == [(2,)]


def test_invariants_hold_on_good_data(run):
    assert check_invariants(run) == {}
    for name in STAGE_TABLES.values():
        assert table_violations(name, table(name, 1)) == [], name
    assert table_violations("prompts", table("prompts", 0)) == []


def test_a_duplicate_key_is_detected_through_the_catalog(tmp_path):
    write_run(tmp_path, iterations=(1,))
    write_table(table("rollouts", 1).slice(0, 1), tmp_path, stage_path(1, "rollouts", part=1))
    refresh_catalog(tmp_path)
    failures = check_invariants(tmp_path)
    assert list(failures) == ["rollouts"]
    assert any("HAVING count(*) > 1" in sql for sql in failures["rollouts"])


def _with(name: str, **changes) -> pa.Table:
    """Table `name` of iteration 1 with its first row changed."""
    changed = rows(name, 1)
    changed[0].update(changes)
    return pa.Table.from_pylist(changed, schema=SCHEMAS[name])


@pytest.mark.parametrize(
    ("name", "changes", "fragment"),
    [
        ("rollouts", {"sample_idx": 1}, "HAVING count(*) > 1"),
        ("rollouts", {"old_log_probs": [-0.4] * 5}, "len(old_log_probs)"),
        ("rollouts", {"ref_log_probs": [-0.1]}, "len(ref_log_probs)"),
        ("rollouts", {"response_length": 7}, "len(response_ids)"),
        ("rollouts", {"prompt_ids": [1]}, "prompt_length"),
        ("rollouts", {"finish_reason": "eos"}, "finish_reason"),
        ("rollouts", {"group_id": 9}, "group_id"),
        ("rewards", {"sample_idx": 1}, "HAVING count(*) > 1"),
        ("rewards", {"score": float("nan")}, "isfinite"),
        ("advantages", {"returns": [0.0]}, "len(returns)"),
        ("advantages", {"values": [0.0] * 9}, 'len("values")'),
        ("advantages", {"train_weight": -1}, "train_weight"),
        ("actor_update", {"mini_batch": 1}, "HAVING count(*) > 1"),
        ("validation", {"finish_reason": "abort"}, "finish_reason"),
        ("prompts", {"prompt_messages": [{"role": "user", "content": "x"}]}, "prompt_messages IS NULL"),
    ],
)
def test_each_kind_of_violation_is_detected(name, changes, fragment):
    failing = table_violations(name, _with(name, **changes))
    assert len(failing) == 1 and fragment in failing[0], failing


def test_a_nan_score_with_an_error_is_allowed():
    assert table_violations("rewards", _with("rewards", score=float("nan"), error="timeout")) == []


def test_query_errors_name_the_available_views(run):
    with pytest.raises(ValueError) as raised:
        query(run, "SELECT * FROM rolouts")
    message = str(raised.value)
    assert "rolouts" in message
    views = "actor_update, advantages, critic_update, filter_groups, metrics, prompts"
    assert f"available views: {views}" in message


def test_a_run_without_catalog_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no catalog at .*has this run finished an iteration"):
        connect_readonly(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"^no run directory at {tmp_path / 'typo'}$"):
        connect_readonly(tmp_path / "typo")


def test_refresh_while_a_reader_is_open_succeeds_and_the_reader_keeps_its_snapshot(tmp_path):
    write_run(tmp_path, iterations=(1,))
    refresh_catalog(tmp_path)
    reader = connect_readonly(tmp_path)
    try:
        assert reader.execute("SELECT count(*) FROM rejects").fetchall() == [(0,)]
        rejects = {"source": ["x.jsonl"], "line": [3], "reason": ["no prompt"], "raw": ["{}"]}
        write_table(pa.table(rejects), tmp_path, "data/rejects.parquet", SCHEMAS["rejects"])
        refresh_catalog(tmp_path)  # no lock is taken on catalog.duckdb: it is replaced
        assert reader.execute("SELECT count(*) FROM rejects").fetchall() == [(0,)]
        assert query(tmp_path, "SELECT count(*) FROM rejects")[1] == [(1,)]
    finally:
        reader.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".catalog-tables.json",
        "catalog.duckdb",
        "config.yaml",
        "data",
        "iter=000001",
    ]


def test_refresh_if_stale_skips_unless_a_table_got_its_first_files(tmp_path):
    write_run(tmp_path, iterations=(1,))
    catalog = refresh_catalog_if_stale(tmp_path)
    built = catalog.stat().st_mtime_ns
    write_run(tmp_path, iterations=(2,))  # more files of tables that already had some: views see them
    assert refresh_catalog_if_stale(tmp_path).stat().st_mtime_ns == built
    assert query(tmp_path, "SELECT count(DISTINCT iter) FROM rollouts")[1] == [(2,)]
    rejects = {"source": ["x.jsonl"], "line": [3], "reason": ["no prompt"], "raw": ["{}"]}
    write_table(pa.table(rejects), tmp_path, "data/rejects.parquet", SCHEMAS["rejects"])
    refresh_catalog_if_stale(tmp_path)
    assert query(tmp_path, "SELECT count(*) FROM rejects")[1] == [(1,)]


def test_a_commit_looks_for_first_files_in_its_own_step_only(tmp_path):
    write_run(tmp_path, iterations=(1,))
    refresh_catalog_if_stale(tmp_path)
    built = (tmp_path / "catalog.duckdb").stat().st_mtime_ns
    recorded = json.loads((tmp_path / ".catalog-tables.json").read_text())
    assert "reward_model" not in recorded
    scored = {"prompt_id": "p0", "sample_idx": 0, "rm_score": 0.5, "input_length": 9}
    rows = pa.Table.from_pylist([scored], schema=SCHEMAS["reward_model"])
    write_table(rows, tmp_path, stage_path(2, "reward_model"), SCHEMAS["reward_model"])
    assert refresh_catalog_if_stale(tmp_path, 1).stat().st_mtime_ns == built  # not step 1's table
    refresh_catalog_if_stale(tmp_path, 2)
    assert "reward_model" in json.loads((tmp_path / ".catalog-tables.json").read_text())
    assert query(tmp_path, "SELECT iter, rm_score FROM reward_model")[1] == [(2, 0.5)]


@pytest.mark.parametrize("planted", [[["metrics"]], {"rollouts": 1}, [*TABLES, "not a table"]])
def test_a_planted_table_record_is_refreshed_over(tmp_path, planted):
    write_run(tmp_path, iterations=(1,))
    refresh_catalog_if_stale(tmp_path)
    recorded = json.loads((tmp_path / ".catalog-tables.json").read_text())
    (tmp_path / ".catalog-tables.json").write_text(json.dumps(planted))
    refresh_catalog_if_stale(tmp_path, 1)
    assert json.loads((tmp_path / ".catalog-tables.json").read_text()) == recorded
    assert query(tmp_path, "SELECT count(DISTINCT iter) FROM rollouts")[1] == [(1,)]


def test_validation_before_training_is_found_at_its_own_step(tmp_path):
    """Step 0 (validation before training) is never committed: the flow checks its folder itself."""
    write_run(tmp_path, iterations=())
    refresh_catalog_if_stale(tmp_path)
    write_table(table("validation", 0), tmp_path, stage_path(0, "validation"), SCHEMAS["validation"])
    refresh_catalog_if_stale(tmp_path, 0)
    assert query(tmp_path, "SELECT DISTINCT iter FROM validation")[1] == [(0,)]


def _hold(path, read_only: bool) -> subprocess.Popen:
    code = f"""
        import duckdb, sys
        con = duckdb.connect({str(path)!r}, read_only={read_only})
        print("open", flush=True)
        sys.stdin.readline()
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "open"
    return proc


def _release(proc: subprocess.Popen) -> None:
    proc.communicate("\n", timeout=120)  # (a hang guard: the holder exits once it reads the line)


def test_other_processes_readers_do_not_block_a_refresh(run):
    proc = _hold(run / CATALOG_NAME, read_only=True)
    try:
        refresh_catalog(run)
        assert query(run, "SELECT count(*) FROM rewards")[1] == [(8,)]
    finally:
        _release(proc)


def test_a_process_holding_the_catalog_read_write_is_retried_then_reported(tmp_path):
    write_run(tmp_path, iterations=(1,))
    refresh_catalog(tmp_path)
    proc = _hold(tmp_path / CATALOG_NAME, read_only=False)
    try:
        with pytest.raises(TimeoutError, match="read-write"):
            connect_readonly(tmp_path, retries=2, wait_s=0.01)
    finally:
        _release(proc)
    with connect_readonly(tmp_path) as con:
        assert con.execute("SELECT count(*) FROM rollouts").fetchall() == [(4,)]


def test_refresh_failure_leaves_the_previous_catalog(tmp_path):
    write_run(tmp_path, iterations=(1,))
    catalog = refresh_catalog(tmp_path)
    before = catalog.read_bytes()
    bad = tmp_path / "iter=000002" / "rewards" / "part-00000.parquet"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not parquet")
    with pytest.raises(duckdb.Error):
        refresh_catalog(tmp_path)
    assert catalog.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".wal"))]
    bad.unlink()
    assert query(tmp_path, "SELECT count(*) FROM rewards")[1] == [(4,)]


@pytest.mark.parametrize(
    "stray", ["iter=000002'", "iter=2", "iter=000002 copy", "iter=0000002", "iter=", "iter=999999999999"]
)
def test_a_stray_step_folder_is_never_read(tmp_path, stray):
    # A folder ppoflow did not name (a copy, a typo) once failed every query of the run's tables with
    # DuckDB's "Could not convert string '' to INT32", naming no folder; so did a number of twelve
    # digits (out of INTEGER's range), also in the explorer and diagnose. Only step folders are read.
    write_run(tmp_path)
    refresh_catalog(tmp_path)
    shutil.copytree(tmp_path / "iter=000002", tmp_path / stray)
    (tmp_path / stray / "rollouts" / "part-00001.parquet").write_bytes(b"not parquet: never opened")
    counts = "SELECT iter, count(*) FROM {} GROUP BY iter ORDER BY iter"
    for name in [*STAGE_TABLES.values(), "metrics", "updates"]:
        per_step = 1 if name == "metrics" else 4 if name == "updates" else len(rows(name, 1))
        assert query(tmp_path, counts.format(name))[1] == [(1, per_step), (2, per_step)], name
    for catalog in (tmp_path / CATALOG_NAME, refresh_catalog(tmp_path)):  # built before it, and after
        with connect_readonly(tmp_path) as con:
            assert con.execute(counts.format("rollouts")).fetchall() == [(1, 4), (2, 4)], catalog
    assert check_invariants(tmp_path) == {}


def test_steps_from_a_million_on_are_read_and_reach_the_catalog_when_committed(tmp_path):
    # iter=1000000 has seven digits: read beside the six-digit folders, and a commit of the first
    # seven-digit step refreshes the catalog, whose views glob each width of step folder.
    write_run(tmp_path, iterations=(999_999,))
    refresh_catalog_if_stale(tmp_path, 999_999)
    write_run(tmp_path, iterations=(1_000_000,))
    assert query(tmp_path, "SELECT DISTINCT iter FROM rewards ORDER BY iter")[1] == [(999_999,), (1_000_000,)]
    refresh_catalog_if_stale(tmp_path, 1_000_000)
    write_run(tmp_path, iterations=(1_000_001,))
    with connect_readonly(tmp_path) as con:
        found = con.execute("SELECT DISTINCT iter FROM metrics ORDER BY iter").fetchall()
    assert found == [(999_999,), (1_000_000,), (1_000_001,)]


def test_ppoflow_query_notes_the_stray_folders_it_did_not_read(tmp_path):
    write_run(tmp_path)
    for stray in ("iter=000002'", "iter=2"):
        shutil.copytree(tmp_path / "iter=000002", tmp_path / stray)
    command = [sys.executable, "-m", "ppoflow", "query", str(tmp_path), "SELECT iter FROM metrics"]
    out = subprocess.run([*command, "--format", "csv"], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "iter\n1\n2\n"), out.stderr
    note = "ppoflow: note: not read, not a step's folder (iter=NNNNNN): 'iter=000002'', 'iter=2'\n"
    assert out.stderr == note


def test_a_query_of_one_step_opens_that_steps_files_only(tmp_path):
    """A reader's view was bound by reading the footer of every step's file (union_by_name): a query
    of one step of a run of 5,000 paid for all of them (and failed on a damaged one). A table's files
    share its columns, so a view is bound from two of them and a filter on `iter` skips the others
    unopened: a damaged file fails only the queries that read it."""
    write_run(tmp_path, iterations=(1, 2, 3))
    for it in (1, 3):
        (tmp_path / stage_path(it, "rewards")).write_bytes(b"PAR1 not a parquet file PAR1")
    one_step = "SELECT iter, count(*), min(score) FROM rewards WHERE iter = 2 GROUP BY iter"
    assert query(tmp_path, one_step)[1] == [(2, 4, 0.9)]
    joined = "SELECT count(*) FROM rollouts JOIN rewards USING (iter, prompt_id, sample_idx) WHERE iter = 2"
    assert query(tmp_path, joined)[1] == [(4,)]
    # A query of every step meets a damaged file: which of the two first is DuckDB's threads' choice.
    with pytest.raises(ValueError, match=r"iter=00000[13]/rewards/part-00000\.parquet"):
        query(tmp_path, "SELECT count(*) FROM rewards")


def test_a_fifo_planted_as_a_table_file_is_not_read(tmp_path):
    """A FIFO named part-00001.parquet in a step's folder made every reader of its table wait forever
    (ppoflow query, diagnose, explore), and a link loop made them fail with a traceback: readers
    list regular files only."""
    import os

    write_run(tmp_path, iterations=(1, 2))
    for table in ("metrics", "rewards"):
        os.mkfifo(tmp_path / f"iter=000002/{table}/part-00001.parquet")
    (tmp_path / "iter=000001/rewards/loop.parquet").symlink_to("loop.parquet")  # a link loop: no file
    (tmp_path / "iter=000003").symlink_to("iter=000003")  # a step folder that is a link loop
    assert query(tmp_path, "SELECT iter, count(*) FROM rewards GROUP BY iter ORDER BY iter")[1] == [
        (1, 4),
        (2, 4),
    ]
    assert query(tmp_path, "SELECT count(*) FROM metrics")[1] == [(2,)]
    assert query(tmp_path, "SELECT count(*) FROM rewards WHERE iter = 2")[1] == [(4,)]


def test_a_file_between_the_first_and_the_last_that_lacks_a_column_is_read_with_nulls(tmp_path):
    """A view is bound from its first and last files: a file in between without one of their columns
    (planted, or written by another version of ppoflow) failed the query ("schema mismatch"); the view
    is then bound from every file, and that file's rows read NULL there."""
    import pyarrow.parquet as pq

    write_run(tmp_path, iterations=(1, 2, 3))
    middle = tmp_path / stage_path(2, "rewards")
    pq.write_table(pq.read_table(middle).drop(["error"]), middle)
    counted = "SELECT iter, count(*), count(ground_truth) FROM rewards GROUP BY iter ORDER BY iter"
    assert query(tmp_path, counted)[1] == [(1, 4, 4), (2, 4, 4), (3, 4, 4)]
    assert query(tmp_path, "SELECT count(*) FROM rewards WHERE error IS NULL AND iter = 2")[1] == [(4,)]
