"""RUN_DIR/flow_runs.json: appended at each flow start, read as untrusted data."""

from __future__ import annotations

import json

import pytest

from ppoflow.tasks.storage.flow_runs import FLOW_RUNS_FILE, KEPT_FLOW_RUNS, read_flow_runs, record_flow_run


def entry(i: int, **changes) -> dict:
    return {
        "id": f"id-{i}",
        "name": f"name-{i}",
        "flow": "ppo-train",
        "started": "2026-12-05T06:00:00+00:00",
        "ui_url": f"http://127.0.0.1:4200/runs/flow-run/id-{i}",
        "temporary_server": False,
    } | changes


def test_records_are_appended_newest_last_and_capped(tmp_path):
    for i in range(KEPT_FLOW_RUNS + 3):
        record_flow_run(tmp_path, entry(i, extra="dropped"))
    kept = read_flow_runs(tmp_path)
    assert [r["id"] for r in kept] == [f"id-{i}" for i in range(3, KEPT_FLOW_RUNS + 3)]
    assert kept[-1] == entry(KEPT_FLOW_RUNS + 2)  # fields outside the record's are not kept


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{ damaged",
        '{"id": "x"}',
        "[1, 2]",
        '[{"id": {"nested": 1}}]',
        '[{"id": ["x"]}]',
        "[" * 100_000 + "]" * 100_000,  # deeper than the JSON reader recurses
        '[{"id": "' + "x" * 2_001 + '"}]',  # a field longer than a record's
        '[{"id": "x", "name": "' + "y" * (2**20) + '"}]',  # a file larger than a record
    ],
)
def test_a_damaged_or_planted_record_reads_as_none(tmp_path, content):
    (tmp_path / FLOW_RUNS_FILE).write_text(content)
    assert read_flow_runs(tmp_path) == []
    record_flow_run(tmp_path, entry(1))  # and the next start records its run anyway
    assert read_flow_runs(tmp_path) == [entry(1)]


@pytest.mark.parametrize(
    "url", ["javascript:alert(1)", "data:text/html,<script>x</script>", "//evil.example/x", " http://x", 7]
)
def test_a_link_that_is_not_http_is_dropped(tmp_path, url):
    (tmp_path / FLOW_RUNS_FILE).write_text(json.dumps([entry(1, ui_url=url)]))
    kept = read_flow_runs(tmp_path)
    assert kept == ([] if url == 7 else [entry(1, ui_url=None)])
