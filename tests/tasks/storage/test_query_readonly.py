"""`ppoflow query` is read-only: each attack of the security review is refused and leaves no trace,
the connection it runs on cannot reach outside the run, and every view still answers the queries
users type."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import duckdb
import pytest

from ppoflow.tasks.retraining.rounds import DataFile, record_round, refresh_retrain_catalog
from ppoflow.tasks.storage.catalog import CATALOG_NAME, connect_readonly, refresh_catalog
from ppoflow.tasks.storage.confined_query import connect_confined, query
from ppoflow.tasks.storage.schemas import metrics_table
from ppoflow.tasks.storage.tables import write_table
from tests.tasks.storage.test_catalog import write_run

READ_ONLY = "ppoflow query runs read-only SELECT statements"
RUN_ONLY = "may read only the run's files"
SECRET = "c0nfidential"
"""The header of the files outside the run: it must never reach an error message."""
FORGED = "iter=000002/metrics/part-00001.parquet"  # the metrics view globs iter=*/metrics/*.parquet
METRICS = "SELECT iter, step FROM metrics ORDER BY iter"
VIEW_ROWS = {
    "rollouts": 8,
    "rewards": 8,
    "advantages": 8,
    "actor_update": 4,
    "critic_update": 4,
    "updates": 8,
    "validation": 8,
    "metrics": 2,
    "prompts": 4,
    "rejects": 0,
}


def make_run(root: Path) -> Path:
    """root/runs/demo (a two-iteration run), a sibling root/runs/demo-evil sharing its name's prefix,
    and root/outside.csv: a file outside every run."""
    run = root / "runs" / "demo"
    write_run(run)
    refresh_catalog(run)
    (root / "runs" / "demo-evil").mkdir()
    (root / "runs" / "demo-evil" / "secret.csv").write_text(f"{SECRET}\n42\n")
    (root / "outside.csv").write_text(f"{SECRET}\n7\n")
    return run


@pytest.fixture
def run(tmp_path) -> Path:
    return make_run(tmp_path)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory) -> Path:
    """A run only read from: the tests that check the views work."""
    return make_run(tmp_path_factory.mktemp("shared"))


def files(root: Path) -> dict[str, str]:
    """Every file under root (links not followed) -> digest of its bytes."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            found[str(path.relative_to(root))] = "link" if path.is_symlink() else _digest(path)
    return found


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def refused(run: Path, sql: str, *fragments: str) -> str:
    """The ValueError message of query(run, sql), which must hold every fragment."""
    with pytest.raises(ValueError) as raised:
        query(run, sql)
    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


WRITES = {
    "copy_outside": ("COPY (SELECT 1) TO '{root}/x.csv'", (READ_ONLY, "COPY")),
    "copy_forges_a_metrics_row": (
        "COPY (SELECT * EXCLUDE (iter) FROM metrics LIMIT 1) TO '{run}/" + FORGED + "' (FORMAT parquet)",
        (READ_ONLY, "COPY"),
    ),
    "attach_creates_a_database": (
        "ATTACH '{run}/new.duckdb' AS n; CREATE TABLE n.t AS SELECT 1",
        (READ_ONLY, "ATTACH"),
    ),
    "attach_outside": (
        "ATTACH '{root}/new.duckdb' AS n; CREATE TABLE n.t AS SELECT 1",
        (READ_ONLY, "ATTACH"),
    ),
    "drop_view_through_a_writable_attach": (
        "USE memory; DETACH catalog; ATTACH '{run}/catalog.duckdb' AS c; DROP VIEW c.main.metrics",
        (READ_ONLY, "SET", "USE memory"),
    ),
    "export": ("EXPORT DATABASE '{root}/export'", (READ_ONLY, "EXPORT")),
    "explain_analyze_runs_a_copy": (
        "EXPLAIN ANALYZE COPY (SELECT * EXCLUDE (iter) FROM metrics) TO '{run}/"
        + FORGED
        + "' (FORMAT parquet)",
        (READ_ONLY, "EXPLAIN"),
    ),
    "explain_analyze_option_runs_a_copy": (
        "EXPLAIN (ANALYZE) COPY (SELECT 1) TO '{root}/x.csv'",
        (READ_ONLY, "EXPLAIN"),
    ),
    "a_read_before_a_write": ("SELECT 1; COPY (SELECT 1) TO '{root}/x.csv'", (READ_ONLY, "COPY")),
    "query_function_runs_a_copy": (
        "SELECT * FROM query('COPY (SELECT 1) TO ''{root}/x.csv''')",
        ("single SELECT statement",),
    ),
    "query_function_runs_an_attach": (
        "SELECT * FROM query('ATTACH ''{run}/new.duckdb'' AS n')",
        ("single SELECT statement",),
    ),
    "query_table_takes_a_name_not_sql": (
        "SELECT * FROM query_table('metrics; COPY (SELECT 1) TO ''{root}/x.csv''')",
        ("does not exist",),
    ),
    "profiling_writes_its_output": (
        "SELECT * FROM enable_profiling(format='json', save_location='{root}/profile.json'); FROM metrics",
        ("locked",),
    ),
    "logging_writes_its_output": (
        "SELECT * FROM enable_logging(storage='file', storage_path='{root}/logs'); FROM metrics",
        ("locked",),
    ),
    "load_an_extension": ("LOAD json", (READ_ONLY, "LOAD")),
    "install_an_extension": ("INSTALL httpfs", (READ_ONLY, "LOAD")),
    "create_a_table": ("CREATE TEMP TABLE t AS SELECT 1", (READ_ONLY, "CREATE")),
    "checkpoint": ("CHECKPOINT", (READ_ONLY, "CALL")),
}


@pytest.mark.parametrize(("sql", "fragments"), WRITES.values(), ids=WRITES.keys())
def test_an_attack_is_refused_and_leaves_no_trace(run, sql, fragments):
    root = run.parent.parent
    before = files(root)
    refused(run, sql.format(run=run, root=root), *fragments)
    assert files(root) == before
    for path in (run / FORGED, run / "new.duckdb", root / "new.duckdb", root / "x.csv", root / "export"):
        assert not path.exists(), path
    assert query(run, METRICS)[1] == [(1, 1), (2, 2)]
    assert query(run, "SELECT count(*) FROM duckdb_views() WHERE view_name = 'metrics'")[1] == [(1,)]


READS = {
    "etc_passwd": "SELECT * FROM read_text('/etc/passwd')",
    "outside_the_run": "SELECT * FROM read_csv('{root}/outside.csv')",
    "dot_dot_out_of_the_run": "SELECT * FROM read_csv('{run}/../../outside.csv')",
    "sibling_sharing_the_runs_prefix": "SELECT * FROM read_csv('{run}-evil/secret.csv')",
    "sibling_by_glob": "SELECT * FROM glob('{run}*/*.csv')",
    "listing_outside_the_run": "SELECT * FROM glob('{root}/*')",
    "through_the_query_function": "SELECT * FROM query('SELECT * FROM read_text(''/etc/passwd'')')",
    "through_serialized_sql": (
        "FROM json_execute_serialized_sql(json_serialize_sql('SELECT * FROM read_text(''/etc/passwd'')'))"
    ),
    "over_the_network": "SELECT * FROM read_text('https://example.com')",
}


@pytest.mark.parametrize("sql", READS.values(), ids=READS.keys())
def test_a_read_outside_the_run_is_refused(run, sql):
    message = refused(run, sql.format(run=run, root=run.parent.parent), RUN_ONLY)
    assert SECRET not in message and "root:" not in message


def test_a_symlink_inside_the_run_does_not_lead_out_of_it(run):
    (run / "link").symlink_to(run.parent.parent, target_is_directory=True)
    refused(run, f"SELECT * FROM read_csv('{run}/link/outside.csv')", RUN_ONLY)
    refused(run, f"SELECT * FROM glob('{run}/link/*')", RUN_ONLY)


SETTINGS = {
    "enable_external_access": "SET enable_external_access = true; SELECT * FROM read_text('/etc/passwd')",
    "reset_external_access": "RESET enable_external_access; SELECT * FROM read_text('/etc/passwd')",
    "unlock": "SET lock_configuration = false",
    "reset_lock": "RESET lock_configuration",
    "allowed_directories": "SET allowed_directories = ['/']",
    "autoload": "SET autoload_known_extensions = true",
    "pragma": "PRAGMA enable_profiling",
    "call": "CALL enable_logging()",
}


@pytest.mark.parametrize("sql", SETTINGS.values(), ids=SETTINGS.keys())
def test_a_setting_cannot_be_changed_through_query(run, sql):
    refused(run, sql, READ_ONLY)


def test_the_confined_connection_reaches_only_the_run_even_without_the_statement_check(run):
    with connect_confined(run) as con:
        for sql in (
            "SELECT * FROM read_text('/etc/passwd')",
            f"SELECT * FROM read_csv('{run}-evil/secret.csv')",
            f"SELECT * FROM read_csv('{run}/../../outside.csv')",
            f"COPY (SELECT 1) TO '{run.parent.parent}/x.csv'",
        ):
            with pytest.raises(duckdb.PermissionException):
                con.execute(sql)
        assert con.execute("SELECT count(*) FROM metrics").fetchall() == [(2,)]
    assert not (run.parent.parent / "x.csv").exists()


def test_the_confined_connections_configuration_is_locked(run):
    with connect_confined(run) as con:
        settings = dict(
            con.execute(
                "SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
                "'allowed_directories', 'autoload_known_extensions', 'autoinstall_known_extensions', "
                "'allow_community_extensions', 'lock_configuration', 'temp_directory')"
            ).fetchall()
        )
        assert settings == {
            "enable_external_access": "false",
            "allowed_directories": f"[{run.resolve()}/]",
            "autoload_known_extensions": "false",
            "autoinstall_known_extensions": "false",
            "allow_community_extensions": "false",
            "lock_configuration": "true",
            "temp_directory": "",
        }
        for sql in (
            "SET enable_external_access = true",
            "RESET enable_external_access",
            "SET lock_configuration = false",
            "RESET lock_configuration",
            "SET allowed_directories = ['/']",
            "SET autoinstall_known_extensions = true",
        ):
            with pytest.raises(duckdb.InvalidInputException, match="locked"):
                con.execute(sql)


def test_a_copied_run_reads_its_own_files_and_a_lone_catalog_is_no_run(run, tmp_path):
    """The views are defined from the files of the folder read, not from its catalog, whose views
    name the run it was built for: a copy reads the copy (changed here, so the original cannot answer)."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for part in copy.glob("iter=000002/*"):
        shutil.rmtree(part)
    assert query(copy, "SELECT DISTINCT iter FROM metrics")[1] == [(1,)]
    assert query(run, "SELECT DISTINCT iter FROM metrics ORDER BY iter")[1] == [(1,), (2,)]
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(run / CATALOG_NAME, lone / CATALOG_NAME)
    with pytest.raises(FileNotFoundError, match="is not a ppoflow run directory"):
        query(lone, "SELECT count(*) FROM metrics")
    with connect_readonly(lone) as con:  # other clients still open the catalog itself
        assert con.execute("SELECT count(*) FROM metrics").fetchall() == [(2,)]


def test_several_reads_run_in_order_and_the_last_ones_rows_are_returned(shared_run):
    assert query(shared_run, "SELECT 1 AS a; SELECT count(*) AS n FROM metrics;") == (["n"], [(2,)])


@pytest.mark.parametrize("sql", ["", "  ;  ", "-- nothing but a comment"])
def test_a_query_without_a_statement_is_a_clear_error(shared_run, sql):
    refused(shared_run, sql, "no SQL statement")


def test_a_sql_error_still_names_the_available_views(shared_run):
    message = refused(shared_run, "SELECT * FROM rolouts", "rolouts", "available views: actor_update")
    assert READ_ONLY not in message and RUN_ONLY not in message


@pytest.mark.parametrize(("view", "count"), VIEW_ROWS.items())
def test_every_view_returns_its_rows_after_the_lockdown(shared_run, view, count):
    assert query(shared_run, f"SELECT count(*) FROM {view}")[1] == [(count,)]
    for connect in (connect_confined, connect_readonly):
        with connect(shared_run) as con:
            assert con.execute(f"SELECT count(*) FROM {view}").fetchall() == [(count,)]


def test_the_queries_users_type_still_work(shared_run):
    def rows(sql):
        return query(shared_run, sql)[1]

    assert ("iter", "INTEGER") in [r[:2] for r in rows("DESCRIBE rollouts")]
    assert {r[0] for r in rows("SUMMARIZE metrics")} >= {"iter", "step"}
    assert rows("WITH last AS (SELECT max(iter) AS i FROM rewards) SELECT i FROM last") == [(2,)]
    assert rows("FROM metrics SELECT iter ORDER BY iter") == [(1,), (2,)]
    assert rows("VALUES (1, 'a')") == [(1, "a")]
    assert {r[0] for r in rows("SHOW TABLES")} >= set(VIEW_ROWS)
    assert rows("SELECT column_type FROM (DESCRIBE rollouts) WHERE column_name = 'iter'") == [("INTEGER",)]
    assert rows("/* iterations */ SELECT count(DISTINCT iter) FROM rollouts") == [(2,)]
    assert rows("SELECT count(*) FROM query('FROM metrics')") == [(2,)]
    assert rows("FROM query_table('metrics') SELECT count(*)") == [(2,)]
    assert rows("PIVOT metrics ON step USING first(iter) ORDER BY 1")[0][-2:] == (1, None)
    for explain in (
        "EXPLAIN SELECT count(*) FROM rollouts",
        "EXPLAIN ANALYZE SELECT count(*) FROM rollouts",
        "EXPLAIN (ANALYZE, FORMAT json) SELECT count(*) FROM rollouts",
        "-- the plan\nEXPLAIN (SELECT 1)",
    ):
        cols, plan = query(shared_run, explain)
        assert cols == ["explain_key", "explain_value"] and plan, explain


def test_the_retraining_catalogs_views_work_after_the_lockdown(tmp_path):
    checkpoint = tmp_path / "rounds/round=000001/checkpoints/iter=000004"
    (checkpoint / "actor").mkdir(parents=True)
    promotion = {
        "decision": "promoted",
        "reason": "test",
        "candidate_score": 0.7,
        "champion_score": 0.5,
        "candidate_checkpoint": str(checkpoint),
        "incumbent": "base",
        "first_step": 1,
        "last_step": 4,
        "train_rows": 512,
        "rejected_rows": 0,
        "flow_run_id": None,
    }
    metrics = metrics_table({"critic/score/mean": 0.7}, step=4)
    write_table(metrics, tmp_path, "rounds/round=000001/iter=000004/metrics/part-00000.parquet")
    record_round(tmp_path, 1, [DataFile(str(tmp_path / "f.jsonl"), "0" * 64, 10)], promotion)
    refresh_retrain_catalog(tmp_path)
    assert query(tmp_path, "SELECT round, decision FROM promotions")[1] == [(1, "promoted")]
    assert query(tmp_path, "SELECT version, bytes FROM dataset_files")[1] == [(1, 10)]
    assert query(tmp_path, 'SELECT round, iter, "critic/score/mean" FROM round_metrics')[1] == [(1, 4, 0.7)]


@pytest.mark.parametrize("planted", ["link", "garbage", "views"])
def test_a_planted_or_damaged_catalog_is_never_read(run, tmp_path, planted):
    """ppoflow's readers run no SQL read from the run: a catalog that is a link to another database,
    that is not a database, or whose metrics view calls a function that writes files (the next
    statement of the connection would write them) changes neither query nor diagnose."""
    from ppoflow.tasks.observe.diagnose import load_run
    from ppoflow.tasks.storage.catalog import _view_sql, write_catalog

    logs = tmp_path / "duck_logs"
    if planted == "link":
        other = tmp_path / "other.duckdb"
        with duckdb.connect(str(other)) as con:
            con.execute(f"CREATE TABLE metrics AS SELECT '{SECRET}' AS secret")
        (run / CATALOG_NAME).unlink()
        (run / CATALOG_NAME).symlink_to(other)
    elif planted == "garbage":
        (run / CATALOG_NAME).write_bytes(b"not a database" * 400)
    else:
        writes_logs = f"enable_logging(storage='file', storage_path='{logs}')"

        def define(con):
            for name in VIEW_ROWS.keys() - {"metrics", "updates"}:
                con.execute(f"CREATE VIEW {name} AS {_view_sql(con, run, name)}")
            planted_sql = f"SELECT 1 AS iter, 1 AS step FROM (SELECT count(*) FROM {writes_logs})"
            con.execute(f"CREATE VIEW metrics AS {planted_sql}")

        write_catalog(run, define)
    columns, rows = query(run, "SELECT * FROM metrics ORDER BY iter")
    assert SECRET not in columns and [r[0] for r in rows] == [1, 2]
    assert sorted(load_run(run).metrics["critic/score/mean"]) == [1, 2]
    assert not logs.exists()


def test_a_run_directory_that_is_a_symbolic_link_loop_is_named(tmp_path):
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(ValueError, match=r"^run directory .*loop is a symbolic link loop: it names nothing$"):
        query(tmp_path / "loop", "SELECT 1")


@pytest.mark.parametrize("target", ["outside.parquet", "outside.csv"])
def test_a_link_planted_in_a_table_folder_is_refused_before_any_file_is_read(run, target):
    """Defining the views reads their files' footers, before the connection is confined: a link that
    leads out of the run is refused first, named with its target and what to do. (outside.csv is not
    parquet: reading its footer would have said the table is damaged.)"""
    outside = run.parent.parent / target
    if target.endswith(".parquet"):
        duckdb.sql(f"COPY (SELECT 2 AS iter, 2 AS step) TO '{outside}'")
    (run / FORGED).symlink_to(outside)
    with pytest.raises(ValueError) as raised:
        query(run, METRICS)
    assert str(raised.value) == (
        f"{run} holds symbolic links that lead out of it, where its views read: {run / FORGED} -> "
        f"{outside}: remove them, or put a copy of the file there"
    )


def test_a_link_where_no_view_reads_is_the_users(run):
    elsewhere = run.parent.parent / "big-disk"
    elsewhere.mkdir()
    (run / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    assert query(run, METRICS)[1] == [(1, 1), (2, 2)]


def test_diagnose_reads_the_newest_steps_of_a_long_run_and_says_so(tmp_path):
    """`ppoflow diagnose` read every step's metrics and rows (28 s for 2,000 steps); it reads the
    newest --last steps (100 by default), and its first line says which of how many."""
    from ppoflow.tasks.observe.diagnose import load_run, render_text

    run = tmp_path / "run"
    write_run(run, iterations=(1, 2, 3, 4))
    oldest = run / "iter=000001" / "rewards" / "part-00000.parquet"
    kept = oldest.read_bytes()
    oldest.write_bytes(b"PAR1 damaged")  # not read
    newest = load_run(run, last=2)
    assert sorted(newest.metrics["critic/score/mean"]) == [3, 4] and newest.window == (3, 4)
    assert sorted(newest.rows["rollouts/truncated"]) == [3, 4]
    header = render_text(run, newest, [])[0]
    assert header.startswith(f"{run}: the newest 2 iteration(s) of 4 steps (from step 3; --last 0 reads")
    oldest.write_bytes(kept)
    every = load_run(run, last=10)
    assert sorted(every.metrics["critic/score/mean"]) == [1, 2, 3, 4] and every.window is None
    assert render_text(run, every, [])[0].startswith(f"{run}: 4 iteration(s), ")
