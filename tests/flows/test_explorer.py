"""`ppoflow explore` on a real 10-step run: the page in a real headless Chromium (Debian's chromium,
driven by Playwright), what it shows checked against DuckDB queries of the same rows; the server's
answers to attacks; a run that trains while the page is open; Ctrl-C. The page's content security
policy forbids eval, which page.wait_for_function needs: the tests wait on selectors instead."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from playwright.sync_api import expect

from ppoflow.tasks.storage.confined_query import query

from .conftest import kept_alive_median_seconds

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
STEPS = 10
RUN = [
    "data.train_batch_size=32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_mini_batch_size=16",
    "critic.ppo_micro_batch_size_per_gpu=16",
]


def train(run_dir: Path, steps: int) -> None:
    from ppoflow.flows.train import ppo_train

    ppo_train(None, [*RUN, f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}"])


@pytest.fixture(scope="module")
def run_dir(prefect_server, tiny_model_dir, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("explored") / "demo"
    train(directory, STEPS)
    return directory


class Explorer:
    """A `ppoflow explore` process: its URL (with the token), its port and its output."""

    def __init__(self, run_dir: Path, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ppoflow", "explore", str(run_dir), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:(\d+)/#token=(\S+))", line)
        if match is None:
            self.process.kill()
            raise AssertionError(f"no URL in {line!r}: {self.process.stderr.read()}")
        self.url, self.port, self.token = match.group(1), int(match.group(2)), match.group(3)

    def get(self, path: str, headers: dict | None = None, token: bool = True) -> tuple[int, str]:
        """A raw request: the path is sent as written (no client normalises `..`)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        sent = {"Host": f"127.0.0.1:{self.port}"} | ({"X-Ppoflow-Token": self.token} if token else {})
        connection.request("GET", path, headers=sent | (headers or {}))
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8", "replace")

    def stop(self) -> tuple[int, str]:
        """Ctrl-C; the exit code and all it printed (killed, and a failure, after 20 s)."""
        self.process.send_signal(signal.SIGINT)
        try:
            out, err = self.process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            raise AssertionError("ppoflow explore did not stop within 20 s of Ctrl-C") from None
        return self.process.returncode, out + err

    def __enter__(self) -> Explorer:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


@pytest.fixture(scope="module")
def explorer(run_dir):
    with Explorer(run_dir) as served:
        yield served


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not os.path.isfile(CHROMIUM):
        pytest.fail("the explorer's browser tests need Debian's chromium: apt-get install chromium")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
        )
        yield launched
        launched.close()


@pytest.fixture
def page(browser, explorer):
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    opened.goto(explorer.url)
    opened.wait_for_selector("#samples tbody tr")
    yield opened
    context.close()
    assert not errors, errors


def rows_of(page) -> list[tuple[str, int, float]]:
    return [
        (row.get_attribute("data-prompt-id"), int(row.get_attribute("data-sample-idx")), float(score))
        for row, score in zip(
            page.locator("#samples tbody tr").all(),
            page.locator("#samples tbody td.score").evaluate_all("cells => cells.map(c => c.dataset.value)"),
            strict=True,
        )
    ]


def reloaded(page, action) -> None:
    """Run `action` (a change that reloads the sample table) and wait until the table shows its rows:
    the table marks which request its rows answer."""
    before = page.locator("#samples").get_attribute("data-shown")
    action()
    expect(page.locator("#samples")).not_to_have_attribute("data-shown", before or "")


def choose(page, selector: str, value: str) -> None:
    reloaded(page, lambda: page.select_option(selector, value))


def test_worst_validation_answers_one_opened_and_compared_across_iterations(page, run_dir):
    choose(page, "#kind", "val")
    choose(page, "#iteration", str(STEPS))
    expected = query(
        run_dir,
        f"SELECT prompt_id, sample_idx, score FROM validation WHERE iter = {STEPS} "
        "ORDER BY score, prompt_id, sample_idx LIMIT 50",
    )[1]
    assert rows_of(page) == [tuple(row) for row in expected]  # sorted by score, lowest first
    total = query(run_dir, f"SELECT count(*) FROM validation WHERE iter = {STEPS}")[1][0][0]
    assert page.locator("#page-info").text_content() == f"rows 1–50 of {total}"
    page.fill("#max-score", "0.5")
    reloaded(page, lambda: page.press("#max-score", "Enter"))
    below = query(run_dir, f"SELECT count(*) FROM validation WHERE iter = {STEPS} AND score <= 0.5")[1][0][0]
    assert page.locator("#page-info").text_content().endswith(f"of {below}")

    worst_id, worst_idx, worst_score = rows_of(page)[0]
    page.locator("#samples tbody tr").first.click()
    expect(page.locator("#sample-section")).to_have_attribute(
        "data-sample", f"val/{STEPS}/{worst_id}/{worst_idx}"
    )
    prompt, response, score = query(
        run_dir,
        f"SELECT prompt_text, response_text, score FROM validation WHERE iter = {STEPS} "
        f"AND prompt_id = '{worst_id}' AND sample_idx = {worst_idx}",
    )[1][0]
    assert page.locator("#sample-prompt").text_content() == prompt
    assert page.locator("#sample-response").text_content() == response
    assert float(page.locator('#sample-facts dd[data-name="score"]').get_attribute("data-value")) == score

    page.select_option("#compare-left", "1")
    page.select_option("#compare-right", str(STEPS))
    page.click("#compare")
    page.wait_for_selector("#compare-view .column")
    for iteration in (1, STEPS):
        column = page.locator(f'#compare-view .column[data-iter="{iteration}"]')
        shown = [
            (float(c.locator(".score").get_attribute("data-value")), c.locator("pre").text_content())
            for c in column.locator(".response").all()
        ]
        assert shown == [
            tuple(row)
            for row in query(
                run_dir,
                f"SELECT score, response_text FROM validation WHERE iter = {iteration} "
                f"AND prompt_id = '{worst_id}' ORDER BY sample_idx",
            )[1]
        ]


def test_a_training_response_coloured_by_advantage(page, run_dir):
    choose(page, "#iteration", str(STEPS))
    reloaded(page, lambda: page.click('#samples th[data-sort="response_length"]'))
    reloaded(page, lambda: page.click('#samples th[data-sort="response_length"]'))  # longest first
    row = page.locator("#samples tbody tr").first
    prompt_id, sample_idx = row.get_attribute("data-prompt-id"), int(row.get_attribute("data-sample-idx"))
    row.click()
    expect(page.locator("#sample-section")).to_have_attribute(
        "data-sample", f"train/{STEPS}/{prompt_id}/{sample_idx}"
    )
    page.select_option("#colour-by", "advantages")
    advantages, length, values = query(
        run_dir,
        f'SELECT a.advantages, r.response_length, a."values" FROM rollouts r JOIN advantages a '
        f"USING (iter, prompt_id, sample_idx) WHERE iter = {STEPS} AND prompt_id = '{prompt_id}' "
        f"AND sample_idx = {sample_idx}",
    )[1][0]
    tokens = page.locator("#tokens .tok")
    assert tokens.count() == length
    shown = tokens.evaluate_all(
        "spans => spans.map(s => [s.dataset.value, getComputedStyle(s).backgroundColor])"
    )
    assert [float(value) for value, _ in shown] == pytest.approx(advantages, abs=0, rel=0)
    for (_, colour), advantage in zip(shown, advantages, strict=True):
        red, _, blue = (int(c) for c in re.findall(r"\d+", colour)[:3])
        if abs(advantage) > 0.05 * max(abs(a) for a in advantages):
            assert (blue > red) == (advantage > 0), (colour, advantage)
    page.select_option("#colour-by", "values")
    assert [float(v) for v in tokens.evaluate_all("spans => spans.map(s => s.dataset.value)")] == values
    tokens.nth(0).click()
    assert page.locator('#token-detail td[data-name="advantage"]').text_content() != ""


def test_the_metric_plot_is_the_metrics_table(page, run_dir):
    chart = page.locator('figure.chart[data-metric="critic/score/mean"]')
    points = chart.locator("circle.point").evaluate_all(
        "dots => dots.map(d => [Number(d.dataset.iter), Number(d.dataset.value)])"
    )
    expected = query(run_dir, 'SELECT iter, "critic/score/mean" FROM metrics WHERE iter >= 1 ORDER BY iter')[
        1
    ]
    assert points == [list(row) for row in expected]
    chart.locator("circle.point").nth(2).click()  # iteration 3
    expect(page.locator("#iteration")).to_have_value("3")


def test_a_planted_response_is_shown_as_text_and_runs_nothing(browser, run_dir, tmp_path):
    planted = tmp_path / "planted"
    shutil.copytree(run_dir, planted, symlinks=True)
    part = planted / "iter=000002/validation/part-00000.parquet"
    table = pq.read_table(part)
    payload = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
    texts = table.column("response_text").to_pylist()
    texts[0] = payload
    pq.write_table(
        table.set_column(table.schema.get_field_index("response_text"), "response_text", [texts]), part
    )
    (planted / "model/base/tokenizer.json").write_text("{ not a tokenizer")
    (planted / "flow_runs.json").write_text('[{"id": "x", "name": "n", "ui_url": "javascript:alert(1)"}]')
    (planted / "catalog.duckdb").write_bytes(b"not a database")
    with Explorer(planted) as served:
        context = browser.new_context()
        page = context.new_page()
        page.goto(served.url)
        page.wait_for_selector("#samples tbody tr")
        choose(page, "#kind", "val")
        choose(page, "#iteration", "2")
        prompt_id = query(
            planted, "SELECT prompt_id FROM validation WHERE iter = 2 AND response_text LIKE '<img%'"
        )
        page.locator(f'#samples tbody tr[data-prompt-id="{prompt_id[1][0][0]}"]').click()
        page.wait_for_selector("#sample-section:not([hidden])")
        assert page.locator("#sample-response").text_content() == payload
        assert page.evaluate("window.__pwned") is None
        assert page.locator("#flow-runs a").count() == 0  # a javascript: link is dropped
        choose(page, "#kind", "train")
        page.locator("#samples tbody tr").first.click()
        page.wait_for_selector("#tokens .tok")
        assert all(re.fullmatch(r"<\d+>", t) for t in page.locator("#tokens .tok").all_text_contents())
        context.close()


def test_a_kept_alive_connection_gets_each_answer_without_a_delayed_ack(explorer):
    """The explorer listens on a TCP socket object (ppoflow/listening.py), so each connection gets
    TCP_NODELAY: on a socket made with protocol 0 every answer on a kept-alive connection waited for
    the browser's delayed ACK, 40 ms or more (a median 44 ms)."""
    median = kept_alive_median_seconds(
        explorer.port, "GET", "/", headers={"Host": f"127.0.0.1:{explorer.port}"}
    )
    assert median < 0.025, median


def test_links_out_of_the_run_are_refused_where_they_are_read(run_dir, tmp_path):
    """A link planted in a step's folder that leads out of the run is never followed: DuckDB's
    confinement refuses it, and the request that meets it is answered with the link and its target;
    the run's other steps are served. (Opening the run reads no step's files.)"""
    planted = tmp_path / "linked"
    shutil.copytree(run_dir, planted, symlinks=True)
    (planted / "iter=000001/rollouts/part-00009.parquet").symlink_to("/etc/passwd")
    with Explorer(planted) as served:
        status, body = served.get("/api/samples?kind=train&iter=1")
        assert status == 400
        assert "symbolic links that lead out of it" in body and "/etc/passwd" in body
        assert "root:" not in body
        assert served.get("/api/samples?kind=train&iter=2")[0] == 200


def test_a_damaged_metrics_file_leaves_its_step_out_named_in_one_line(run_dir, tmp_path):
    """A metrics file that cannot be read made `ppoflow explore` exit 2 with DuckDB's five lines, and
    one damaged while it ran made every plot and the run itself answer 400. Its step is left out of
    the plots instead, named in one line on the terminal and on the page."""
    planted = tmp_path / "damaged"
    shutil.copytree(run_dir, planted)
    damaged = next((planted / "iter=000003/metrics").glob("*.parquet"))
    damaged.write_bytes(damaged.read_bytes()[:100])
    with Explorer(planted) as served:
        names = "/api/metrics?names=critic/score/mean"
        status, body = served.get(names)
        assert status == 200
        assert json.loads(body)["iterations"] == [s for s in range(STEPS + 1) if s != 3]
        later = next((planted / "iter=000006/metrics").glob("*.parquet"))
        later.write_bytes(b"PAR1 not a parquet file, written while the explorer runs")
        status, body = served.get(names)
        assert status == 200
        assert json.loads(body)["iterations"] == [s for s in range(STEPS + 1) if s not in (3, 6)]
        status, body = served.get("/api/run")
        left_out = json.loads(body)["left_out"]
        assert status == 200 and [line.split(" left out")[0] for line in left_out] == ["step 3", "step 6"]
        assert all("\n" not in line and "metrics" in line for line in left_out)
        code, printed = served.stop()
    assert code == 0
    noted = [line for line in printed.splitlines() if "left out" in line]
    assert noted == [f"ppoflow explore: {line}" for line in left_out]


@pytest.mark.parametrize(
    "path",
    [
        "/../../../../etc/passwd",
        "/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/explorer.js/../../config.yaml",
        "/config.yaml",
        "/iter=000001/_manifest.json",
        "/static/../server.py",
        "//etc/passwd",
    ],
)
def test_no_request_path_reaches_a_file(explorer, path):
    status, body = explorer.get(path)
    assert status == 404
    assert "root:" not in body and "actor_rollout_ref" not in body and "import" not in body


def test_sql_in_a_request_is_a_value_or_refused(explorer, run_dir):
    status, body = explorer.get("/api/samples?kind=val&iter=1&source=x%27%20OR%20%271%27%3D%271")
    assert status == 200 and '"total":0' in body  # the filter value is a string, bound
    status, body = explorer.get("/api/samples?kind=val&iter=1&sort=score;DROP%20VIEW%20validation")
    assert status == 400 and "sort must be one of" in body
    status, body = explorer.get('/api/metrics?names=iter"%20FROM%20metrics;--')
    assert status == 400 and "no metric named" in body
    status, body = explorer.get("/api/sample?kind=train&iter=1&prompt_id=%27%20OR%201%3D1%20--&sample_idx=0")
    assert status == 400 and "no train sample" in body
    status, body = explorer.get("/api/sample?kind=train&iter=1&prompt_id=../../etc/passwd&sample_idx=0")
    assert status == 400 and "root:" not in body
    status, body = explorer.get("/api/samples?kind=rollouts;--&iter=1")
    assert status == 400 and "kind must be one of" in body
    for bad, message in (
        ("page_rows=0", "page_rows must be"),
        ("order=sideways", "order must be one of"),
        ("min_length=2.5", "min_length must be a whole number"),
        ("page=99999999999999999999", "page must be 0–"),
        ("iter=" + "9" * 4000, "iter must be a whole number, not '9999"),
        ("min_score=nan", "min_score must be a number"),
    ):
        status, body = explorer.get(f"/api/samples?kind=val&iter=1&{bad}")
        assert status == 400 and message in body and len(body) < 300, (bad, body)
    assert explorer.get("/api/samples?kind=val&iter=1&min_length=2.0")[0] == 200
    assert query(run_dir, "SELECT count(*) FROM validation WHERE iter = 1")[1][0][0] > 0  # nothing changed


def test_requests_without_the_token_or_for_another_host_are_refused(explorer):
    assert explorer.get("/api/run", token=False)[0] == 401
    assert explorer.get("/api/run", headers={"X-Ppoflow-Token": "guess"})[0] == 401
    status, body = explorer.get("/api/run", headers={"Host": "evil.example:80"})  # DNS rebinding
    assert status == 403 and "loopback" in body
    assert explorer.get("/", headers={"Host": f"localhost:{explorer.port}"})[0] == 200


def test_a_request_from_beyond_loopback_is_refused(run_dir):
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from ppoflow.explorer.server import explorer_app

    app, reader = explorer_app(run_dir, "t0ken")

    async def ask(client_address: str, host: str) -> int:
        transport = httpx.ASGITransport(app=app, client=(client_address, 50000))
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as client:
            return (await client.get("/api/run", headers={"X-Ppoflow-Token": "t0ken"})).status_code

    def status(client_address: str, host: str) -> int:  # in a thread: Playwright's loop runs in this one
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, ask(client_address, host)).result()

    try:
        assert status("192.0.2.7", "127.0.0.1:8000") == 403
        assert status("10.1.2.3", "localhost:8000") == 403
        assert status("127.0.0.1", "127.0.0.1:8000") == 200
        assert status("::1", "[::1]:8000") == 200
    finally:
        reader.close()


def test_a_host_beyond_loopback_needs_allow_remote(run_dir):
    out = subprocess.run(
        [sys.executable, "-m", "ppoflow", "explore", str(run_dir), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--allow-remote" in out.stderr


def test_new_iterations_appear_while_the_run_trains_and_ctrl_c_leaves_nothing(browser, run_dir, tmp_path):
    growing = tmp_path / "growing"
    shutil.copytree(run_dir, growing, symlinks=True)
    with Explorer(growing) as served:
        context = browser.new_context()
        page = context.new_page()
        page.goto(served.url)
        page.wait_for_selector("#samples tbody tr")
        assert page.locator("#iteration option").all_text_contents()[-1] == str(STEPS)
        train(growing, STEPS + 1)  # the explorer's reads take no lock: training goes on beside them
        page.wait_for_selector(f'#iteration option[value="{STEPS + 1}"]', state="attached", timeout=30_000)
        context.close()
        before = sorted(str(p.relative_to(growing)) for p in growing.rglob("*"))
        code, output = served.stop()
    assert code == 0 and "stopped" in output and "Traceback" not in output
    assert sorted(str(p.relative_to(growing)) for p in growing.rglob("*")) == before  # nothing written
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection("127.0.0.1", served.port, timeout=5).request("GET", "/")


def test_a_run_opened_before_its_first_step_fills_in_as_its_files_appear(browser, run_dir, tmp_path):
    """The page open on a run that has only its config and data, then its step folders appearing one
    by one as training writes them (each folder whole, as a step's files are renamed into place)."""
    starting = tmp_path / "starting"
    starting.mkdir()
    for name in ("config.yaml", "data", "model"):
        (shutil.copytree if (run_dir / name).is_dir() else shutil.copy)(run_dir / name, starting / name)
    with Explorer(starting) as served:
        context = browser.new_context()
        page = context.new_page()
        page.goto(served.url)
        expect(page.locator("#page-info")).to_have_text("no samples yet")
        for step in range(3):
            shutil.copytree(run_dir / f"iter={step:06d}", starting / f"iter={step:06d}")
        expect(page.locator("#iteration")).to_have_value("2", timeout=20_000)
        rows = query(run_dir, "SELECT count(*) FROM rollouts WHERE iter = 2")[1][0][0]
        expect(page.locator("#samples tbody tr")).to_have_count(min(rows, 50))
        expect(page.locator('figure.chart[data-metric="critic/score/mean"] circle.point')).to_have_count(2)
        assert page.locator("#metric-picker option").count() > 10
        context.close()


def test_ctrl_c_during_a_burst_of_requests_stops_at_once_without_a_traceback(explorer, run_dir):
    from concurrent.futures import ThreadPoolExecutor

    with Explorer(run_dir) as served:
        paths = [f"/api/samples?kind=train&iter={1 + i % STEPS}&sort=response_length" for i in range(40)]

        def ask(path: str) -> int:
            try:
                return served.get(path)[0]
            except OSError:  # the server went away first
                return 0

        with ThreadPoolExecutor(20) as pool:
            answers = [pool.submit(ask, path) for path in paths]
            time.sleep(0.05)
            started = time.monotonic()
            code, output = served.stop()
            stopped_after = time.monotonic() - started
        assert {a.result() for a in answers} <= {0, 200, 400, 503}
    assert code == 0 and "Traceback" not in output and "Error" not in output, output
    assert stopped_after < 8, stopped_after


def test_a_page_of_samples_is_the_sql_of_the_same_rows(run_dir):
    from ppoflow.tasks.observe.explorer_data import ExplorerError, RunExplorer, SampleFilter

    reader = RunExplorer(run_dir)
    try:
        wanted = SampleFilter(
            kind="train", iteration=4, min_score=0.05, max_length=3, truncated=False,
            sort="response_length", descending=True, page=1, page_rows=7,
        )  # fmt: skip
        shown = reader.samples(wanted)
        where = "r.iter = 4 AND w.score >= 0.05 AND r.response_length <= 3 AND r.finish_reason <> 'length'"
        expected = query(
            run_dir,
            "SELECT r.prompt_id, r.sample_idx, w.score, r.response_length FROM rollouts r "
            f"JOIN rewards w USING (iter, prompt_id, sample_idx) WHERE {where} "
            "ORDER BY r.response_length DESC, r.prompt_id, r.sample_idx LIMIT 7 OFFSET 7",
        )[1]
        assert [
            (r["prompt_id"], r["sample_idx"], r["score"], r["response_length"]) for r in shown["rows"]
        ] == [tuple(row) for row in expected]
        assert len(expected) == 7
        count = query(
            run_dir,
            "SELECT count(*) FROM rollouts r JOIN rewards w USING (iter, prompt_id, sample_idx) "
            f"WHERE {where}",
        )[1][0][0]
        assert shown["total"] == count
        for bad, message in (
            (SampleFilter(kind="rollouts"), "kind must be one of"),
            (SampleFilter(sort="score DESC"), "sort must be one of"),
            (SampleFilter(page_rows=0), "page_rows must be"),
            (SampleFilter(page_rows=201), "page_rows must be"),
            (SampleFilter(page=-1), "page must be"),
            (SampleFilter(min_score=float("nan")), "finite"),
        ):
            with pytest.raises(ExplorerError, match=message):
                reader.samples(bad)
        assert reader.samples(SampleFilter(iteration=4, page=10**6))["rows"] == []
        with pytest.raises(ExplorerError, match="no train sample"):
            reader.sample("train", 4, "no-such-prompt", 0)
    finally:
        reader.close()


def test_planted_values_are_shown_as_no_value_not_as_an_error(run_dir, tmp_path):
    """A NaN score (a reward function's failure) is no score: not the highest, not in a score range
    (a NaN written by pyarrow, whose statistics leave it out: DuckDB then folds isnan() to false);
    per-token lists of the wrong length, null values and ids beyond the vocabulary are shown as far
    as they go."""
    from ppoflow.tasks.observe.explorer_data import RunExplorer, SampleFilter

    planted = tmp_path / "planted"
    shutil.copytree(run_dir, planted, symlinks=True)
    rewards = next((planted / "iter=000002/rewards").glob("*.parquet"))
    table = pq.read_table(rewards)
    scores = table.column("score").to_pylist()
    scores[0] = float("nan")
    at = table.schema.get_field_index("score")
    pq.write_table(table.set_column(at, table.schema.field(at), [scores]), rewards)
    nan_key = (table.column("prompt_id")[0].as_py(), table.column("sample_idx")[0].as_py())
    rollouts = next((planted / "iter=000002/rollouts").glob("*.parquet"))
    table = pq.read_table(rollouts)
    ids = table.column("response_ids").to_pylist()
    old = table.column("old_log_probs").to_pylist()
    ids[0] = [-5, 10**9, *ids[0]]  # two more tokens than the row's other lists
    old[0] = [None, *old[0][1:]]
    for name, values, type_ in (("response_ids", ids, pa.int32()), ("old_log_probs", old, pa.float32())):
        at = table.schema.get_field_index(name)  # (a planted file: its own schema, nullable items)
        table = table.set_column(at, name, pa.array(values, type=pa.list_(type_)))
    pq.write_table(table, rollouts)
    reader = RunExplorer(planted)
    try:
        highest = reader.samples(SampleFilter(iteration=2, descending=True))["rows"]
        assert (highest[0]["prompt_id"], highest[0]["sample_idx"]) != nan_key and highest[0][
            "score"
        ] is not None
        ranged = reader.samples(SampleFilter(iteration=2, min_score=-1e9, page_rows=200))
        assert nan_key not in {(r["prompt_id"], r["sample_idx"]) for r in ranged["rows"]}
        lowest = reader.samples(SampleFilter(iteration=2, page_rows=200))  # no score: last
        assert lowest["rows"][-1]["score"] is None
        key = (table.column("prompt_id")[0].as_py(), table.column("sample_idx")[0].as_py())
        sample = reader.sample("train", 2, *key)
        assert sample["tokens"][:2] == ["<-5>", "<1000000000>"]
        columns = sample["token_columns"]
        assert all(len(values) == len(sample["tokens"]) for values in columns.values())
        assert columns["old_log_probs"][0] is None and columns["ratio_old_to_rollout"][0] is None
        assert columns["advantages"][-2:] == [None, None]
    finally:
        reader.close()


def test_a_step_of_huge_texts_is_refused_by_its_size_not_read(run_dir, tmp_path):
    """A planted file of long texts, small on disk (each value stored once), took the explorer from
    144 MB to 1.6 GB: DuckDB reads a column's values whole even to show their first characters. The
    step's page is refused with its size, found without reading the texts; the explorer stays small."""
    planted = tmp_path / "huge"
    shutil.copytree(run_dir, planted)
    rollouts = next((planted / "iter=000002/rollouts").glob("*.parquet"))
    table = pq.read_table(rollouts)
    at = table.schema.get_field_index("response_text")
    texts = pa.array(["x" * 10_000_000] * table.num_rows)
    pq.write_table(table.set_column(at, table.schema.field(at), texts), rollouts, compression="zstd")
    assert rollouts.stat().st_size < 2_000_000
    with Explorer(planted) as served:
        status, body = served.get("/api/samples?kind=train&iter=2")
        assert status == 400
        assert json.loads(body)["error"] == (
            "iter=000002/rollouts: its response_text holds 305 MiB of text once read, more than the "
            "explorer reads (128 MiB); ppoflow query reads it"
        )
        assert served.get("/api/samples?kind=train&iter=3")[0] == 200
        status_file = Path(f"/proc/{served.process.pid}/status").read_text()
        assert int(status_file.split("VmHWM:")[1].split()[0]) < 400_000  # kB: the peak stays small
