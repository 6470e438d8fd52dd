"""`ppoflow report` and summary_markdown on real runs of the tiny model (shared with test_diagnose):
one valid PNG per panel whose curves hold the run's numbers, and a markdown summary that quotes them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from ppoflow.tasks.observe.report import ACTOR, panel_figures, sparkline, summary_markdown, write_report
from ppoflow.tasks.storage.catalog import refresh_catalog
from ppoflow.tasks.storage.confined_query import query

from .test_diagnose import TRAINED, real_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(prefect_server, tiny_model_dir, tmp_path_factory):
    return lambda name: real_run(tmp_path_factory, name)


def column(run_dir, sql: str) -> list:
    return [row[0] for row in query(run_dir, sql)[1]]


def test_sparkline_scales_between_min_and_max():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁" and sparkline([]) == ""


def test_the_report_replaces_what_was_planted_in_its_folder_and_refuses_a_linked_one(runs, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(runs("overfit"), copy)
    refresh_catalog(copy)  # its views name the run's own files
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "bashrc").write_text("precious")
    (copy / "report").mkdir(exist_ok=True)
    (copy / "report/report.md").symlink_to(outside / "bashrc")  # written through, it would clobber it
    os.mkfifo(copy / "report/actor.png")  # written into, it would hang
    write_report(copy)
    assert (outside / "bashrc").read_text() == "precious"
    assert (
        not (copy / "report/report.md").is_symlink()
        and "### Charts" in (copy / "report/report.md").read_text()
    )
    assert (copy / "report/actor.png").read_bytes().startswith(PNG_SIGNATURE)
    shutil.rmtree(copy / "report")
    (copy / "report").symlink_to(outside)
    with pytest.raises(OSError, match="refusing to write through a link inside the run"):
        write_report(copy)
    assert [p.name for p in outside.iterdir()] == ["bashrc"]


def test_report_writes_one_valid_png_per_panel_and_report_md(runs, tmp_path):
    run_dir = runs("overfit")
    written = write_report(run_dir, tmp_path / "out")
    names = sorted(p.name for p in written)
    panels = ["actor.png", "critic.png", "rewards.png", "timings.png", "validation.png"]
    assert names == sorted([*panels, "report.md"])
    for name in panels:
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, name
        with Image.open(tmp_path / "out" / name) as image:
            image.verify()
        with Image.open(tmp_path / "out" / name) as image:
            low, high = image.convert("L").getextrema()
            assert image.width >= 600 and image.height >= 300 and high - low > 100, name  # not blank
    report = (tmp_path / "out" / "report.md").read_text()
    assert all(f"]({name})" in report for name in panels)
    assert report.startswith(summary_markdown(run_dir))


def test_panels_plot_the_runs_numbers(runs):
    run_dir = runs("overfit")
    figures = panel_figures(run_dir)
    assert list(figures) == ["actor", "critic", "rewards", "validation", "timings"]
    actor = {ax.get_title(): ax for ax in figures["actor"].axes}
    assert list(actor) == list(ACTOR)
    kl = column(run_dir, f'SELECT "actor/ppo_kl" FROM metrics {TRAINED} ORDER BY iter')
    assert list(actor["actor/ppo_kl"].lines[0].get_ydata()) == pytest.approx(kl)
    critic = {ax.get_title(): ax for ax in figures["critic"].axes}
    values_vs_returns = critic["values vs returns (mean, min–max)"]
    returns = column(run_dir, f'SELECT "critic/returns/mean" FROM metrics {TRAINED} ORDER BY iter')
    lines = {line.get_label(): line for line in values_vs_returns.lines}
    assert list(lines["returns R"].get_ydata()) == pytest.approx(returns)
    (val_ax,) = figures["validation"].axes
    val = column(run_dir, "SELECT avg(score) FROM validation GROUP BY iter ORDER BY iter")
    val_line = next(line for line in val_ax.lines if line.get_label().startswith("validation"))
    assert list(val_line.get_xdata()) == list(range(6)) and list(val_line.get_ydata()) == pytest.approx(val)
    # Each reward component beside the score (the addition task's correctness and format).
    for component in ("correctness", "format"):
        (line,) = [line for line in val_ax.lines if line.get_label() == f"ppoflow/addition {component}"]
        means = column(
            run_dir, f"SELECT avg(components['{component}']) FROM validation GROUP BY iter ORDER BY iter"
        )
        assert list(line.get_xdata()) == [0, 1, 2, 3, 4, 5] and list(line.get_ydata()) == pytest.approx(means)
    assert list(val_ax.get_xticks()) == [0, 1, 2, 3, 4, 5]  # a tick at each iteration
    assert list(actor["actor/ppo_kl"].get_xticks()) == [1, 2, 3, 4, 5]
    (timing_ax,) = figures["timings"].axes
    stages = {t.get_text() for t in timing_ax.get_legend().get_texts()}
    assert {
        "gen",
        "old_log_prob",
        "reward",
        "values",
        "adv",
        "update_actor",
        "update_critic",
        "testing",
    } <= stages
    # The stacked stages add up to verl's timing_s/step, drawn as the line on top.
    (total,) = [line for line in timing_ax.lines if line.get_label() == "step (total)"]
    step = column(run_dir, f'SELECT "timing_s/step" FROM metrics {TRAINED} ORDER BY iter')
    assert list(total.get_ydata()) == pytest.approx(step)
    stage_sums = column(
        run_dir,
        "SELECT "
        + " + ".join(f'"timing_s/{s}"' for s in sorted(stages - {"step (total)"}))
        + f" FROM metrics {TRAINED} ORDER BY iter",
    )
    assert stage_sums == pytest.approx(step)


def test_one_iteration_draws_stacked_bars_and_integer_ticks(runs):
    run_dir = runs("one_iteration")
    figures = panel_figures(run_dir)
    assert list(figures) == ["actor", "critic", "rewards", "validation", "timings"]
    for name, fig in figures.items():
        for ax in fig.axes:
            ticks = [1] if name != "validation" else [0, 1]  # validation also before training
            assert list(ax.get_xticks()) == ticks, (name, ax.get_title())
    (timing_ax,) = figures["timings"].axes
    assert not timing_ax.collections  # a stackplot over one x would be an invisible area
    bars = [(bar.get_x() + bar.get_width() / 2, bar.get_y(), bar.get_height()) for bar in timing_ax.patches]
    assert {x for x, _, _ in bars} == {1.0} and len(bars) >= 6
    bottoms = [bottom for _, bottom, _ in bars]
    assert bottoms == sorted(bottoms) and bottoms[0] == 0.0  # stacked
    step = column(run_dir, f'SELECT "timing_s/step" FROM metrics {TRAINED}')
    assert [sum(height for _, _, height in bars)] == pytest.approx(step)


def test_validation_only_run_has_its_validation_panel_and_summary(runs, tmp_path):
    run_dir = runs("val_only")
    written = {p.name for p in write_report(run_dir, tmp_path)}
    assert written == {"validation.png", "report.md"}
    report = (tmp_path / "report.md").read_text()
    score = column(run_dir, "SELECT avg(score) FROM validation")[0]
    assert f"| 0 | {score:.4g} |" in report and "validation-only run, trainer.val_only" in report
    # its metrics row: the validation metrics of iteration 0
    assert "**Validation metrics** (iteration 0;" in report
    assert f"| `val-core/ppoflow/addition/acc/mean@1` | {score:.4g} |" in report
    assert "No data for: actor, critic, rewards, timings." in report
    assert 'FROM validation GROUP BY ALL ORDER BY ALL"`' in report  # the query to try reads validation


def test_grpo_report_has_no_critic_panel(runs, tmp_path):
    run_dir = runs("zero_grpo")
    written = {p.name for p in write_report(run_dir, tmp_path)}
    assert written == {"actor.png", "rewards.png", "timings.png", "report.md"}
    assert "No data for: critic, validation." in (tmp_path / "report.md").read_text()


def test_summary_markdown_quotes_the_runs_numbers_and_findings(runs):
    run_dir = runs("overfit")
    text = summary_markdown(run_dir)
    val = column(run_dir, "SELECT avg(score) FROM validation GROUP BY iter ORDER BY iter")
    assert f"{val[0]:.4g} → {val[-1]:.4g}" in text and f"`{sparkline(val)}`" in text
    for iteration, score in enumerate(val):
        assert f"| {iteration} | {score:.4g} |" in text
    last = query(run_dir, 'SELECT "critic/score/mean", "actor/entropy" FROM metrics WHERE iter = 5')[1][0]
    assert "(iteration 5)" in text
    assert (
        f"| `critic/score/mean` | {last[0]:.4g} |" in text and f"| `actor/entropy` | {last[1]:.4g} |" in text
    )
    assert "**warning** `validation_diverges`" in text
    assert "change `data.train_max_samples`: 32 → raise it, or -1 for every prompt" in text
    assert f"{run_dir.resolve()}/checkpoints/iter=000005/actor" in text
    assert f"ppoflow query {run_dir.resolve()}" in text


def test_report_module_does_not_import_prefect():
    code = "import sys, ppoflow.tasks.observe.report; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_cli_report_default_folder_and_bad_input(runs, tmp_path):
    run_dir = runs("collapse")
    out = subprocess.run(
        [sys.executable, "-m", "ppoflow", "report", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert str(run_dir / "report" / "actor.png") in out.stdout
    assert (run_dir / "report" / "validation.png").stat().st_size > 0
    assert "`entropy_collapse`" in (run_dir / "report" / "report.md").read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "ppoflow", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "not a ppoflow run directory" in bad.stderr
