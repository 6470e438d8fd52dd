"""`ppoflow report`: one PNG per panel a PPO practitioner looks at (actor, critic, rewards and
lengths, validation, timings) and report.md; `summary_markdown` is the same summary as text
(validation curve, final metrics, diagnose findings, where the data is) for any finished run
directory, e.g. for a markdown artifact at the end of a training run. Charts use matplotlib's
object API on the Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ppoflow.tasks.observe.console import EXAMPLE_QUERY, VALIDATION_QUERY
from ppoflow.tasks.observe.diagnose import RunDirError, diagnose, load_run, require_iteration, validation_only
from ppoflow.tasks.observe.diagnose_policy import CLIPFRAC_HIGH, KL_HIGH
from ppoflow.tasks.observe.diagnose_run import RunData
from ppoflow.tasks.storage.confined_query import query
from ppoflow.tasks.storage.regular_files import refuse_links_below
from ppoflow.tasks.storage.tables import saved_folders, write_bytes_atomic, write_text_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PANELS", "panel_figures", "sparkline", "summary_markdown", "validation_curve", "write_report"]

ACTOR = ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm", "actor/lr")
THRESHOLDS = {"actor/ppo_kl": KL_HIGH, "actor/pg_clipfrac": CLIPFRAC_HIGH}
"""diagnose's limits, drawn dashed when the curve comes within a factor 2 of them."""
HEADLINE_METRICS = (
    "critic/score/mean",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/vf_explained_var",
    "response_length/mean",
    "response_length/clip_ratio",
    "perf/time_per_step",
)
"""The summary's final metrics, and the columns of the Prefect metrics table artifact."""
SPARK = "▁▂▃▄▅▆▇█"
ITERATION_TICKS = 12
"""Up to this many iterations, each gets its tick; beyond, matplotlib picks integer ticks."""


def sparkline(values: list[float]) -> str:
    """One block character per value, scaled between the smallest and the largest."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[round((v - low) / span * (len(SPARK) - 1))] for v in values)


VALIDATION_CURVE = "SELECT data_source, iter, avg(score) FROM validation GROUP BY ALL ORDER BY ALL"


def validation_curve(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """data_source -> [(iter, mean validation score)], every validated iteration (0 = before training)."""
    try:
        rows = query(run_dir, VALIDATION_CURVE)[1]
    except ValueError as error:  # a damaged table file
        raise RunDirError(f"{run_dir}: cannot read the run's tables: {error}") from error
    curve: dict[str, list[tuple[int, float]]] = {}
    for source, iteration, score in rows:
        curve.setdefault(source, []).append((int(iteration), float(score)))
    return curve


def _grid(title: str, n: int, iters: list[int], cols: int = 3) -> tuple[Figure, list]:
    # matplotlib (~0.5 s to import) only when drawing: summary_markdown runs at the end of every flow run.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, MaxNLocator

    cols = min(cols, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(4.4 * cols, 3.1 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontweight="bold")
    axes = [fig.add_subplot(rows, cols, k + 1) for k in range(n)]
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xlabel("iteration")
        # A tick at each iteration while they fit; MaxNLocator alone falls back to fractional ticks
        # (0.945 … 1.05) when the axis spans a single iteration.
        few = len(iters) <= ITERATION_TICKS
        ax.xaxis.set_major_locator(FixedLocator(iters) if few else MaxNLocator(integer=True))
        if len(iters) == 1:
            ax.set_xlim(iters[0] - 1, iters[0] + 1)
    return fig, axes


def _iterations(run: RunData, curve: dict[str, list[tuple[int, float]]] | None = None) -> list[int]:
    """Every iteration that trained (and every one with a validation score, given the curve)."""
    found = set(run.trained_iterations())
    return sorted(found | {i for points in (curve or {}).values() for i, _ in points})


def _plot(ax, points: list[tuple[int, float]], label: str | None = None, **style) -> None:
    if points:
        size = 3 if len(points) > 1 else 6  # a lone point is all there is to see
        ax.plot(
            [i for i, _ in points], [v for _, v in points], marker="o", markersize=size, label=label, **style
        )


def _band(ax, run: RunData, prefix: str, label: str, color: str) -> None:
    """prefix/mean as a line over a shaded prefix/min..prefix/max band."""
    mean = run.series(f"{prefix}/mean")
    low, high = dict(run.series(f"{prefix}/min")), dict(run.series(f"{prefix}/max"))
    inside = [(i, v) for i, v in mean if i in low and i in high]
    iters = [i for i, _ in inside]
    if len(inside) > 1:
        ax.fill_between(iters, [low[i] for i in iters], [high[i] for i in iters], color=color, alpha=0.15)
    elif inside:  # a band over one iteration has no width: min–max as an error bar
        ((i, v),) = inside
        ax.errorbar(
            [i], [v], yerr=[[v - low[i]], [high[i] - v]], fmt="none", color=color, alpha=0.4, capsize=8
        )
    _plot(ax, mean, label, color=color)


def actor_panel(run: RunData) -> Figure | None:
    metrics = [m for m in ACTOR if run.series(m)]
    if not metrics:
        return None
    fig, axes = _grid("actor", len(metrics), _iterations(run))
    for ax, metric in zip(axes, metrics, strict=True):
        points = run.series(metric)
        _plot(ax, points, color="tab:blue")
        limit = THRESHOLDS.get(metric)
        if limit is not None and max(v for _, v in points) > limit / 2:
            ax.axhline(limit, color="tab:red", linestyle="--", linewidth=1, label=f"diagnose limit {limit:g}")
            ax.legend(fontsize=7)
        ax.set_title(metric, fontsize=10)
    return fig


def critic_panel(run: RunData) -> Figure | None:
    if not run.series("critic/vf_loss") and not run.series("critic/values/mean"):
        return None  # critic-free estimators (GRPO, RLOO, …)
    fig, (loss, ev, values, clip) = _grid("critic", 4, _iterations(run), cols=2)
    _plot(loss, run.series("critic/vf_loss"), color="tab:blue")
    loss.set_title("critic/vf_loss", fontsize=10)
    _plot(ev, run.series("critic/vf_explained_var"), color="tab:blue")
    ev.axhline(0.0, color="grey", linewidth=1)
    ev.set_title("critic/vf_explained_var (1 = perfect fit)", fontsize=10)
    _band(values, run, "critic/values", "values V(s)", "tab:orange")
    _band(values, run, "critic/returns", "returns R", "tab:green")
    values.set_title("values vs returns (mean, min–max)", fontsize=10)
    values.legend(fontsize=7)
    _plot(clip, run.series("critic/vf_clipfrac"), color="tab:blue")
    clip.set_title("critic/vf_clipfrac", fontsize=10)
    return fig


def rewards_panel(run: RunData) -> Figure | None:
    if not run.series("critic/score/mean"):
        return None
    fig, (score, length, clip) = _grid("rewards and response lengths", 3, _iterations(run))
    _band(score, run, "critic/score", "score (mean, min–max)", "tab:blue")
    with_kl = run.series("critic/rewards/mean")
    if any(abs(v - run.metrics["critic/score/mean"].get(i, v)) > 1e-6 for i, v in with_kl):
        _plot(score, with_kl, "reward incl. KL penalty", color="tab:purple")
    score.set_title("critic/score", fontsize=10)
    score.legend(fontsize=7)
    _band(length, run, "response_length", "tokens (mean, min–max)", "tab:green")
    length.set_title("response_length", fontsize=10)
    length.legend(fontsize=7)
    _plot(clip, run.series("response_length/clip_ratio"), "length == max (clip_ratio)", color="tab:red")
    _plot(clip, run.series("rollouts/truncated"), "stopped by the limit", color="tab:orange", linestyle=":")
    clip.set_ylim(-0.05, 1.05)
    clip.set_title("response_length/clip_ratio", fontsize=10)
    clip.legend(fontsize=7)
    return fig


def validation_panel(run: RunData, curve: dict[str, list[tuple[int, float]]]) -> Figure | None:
    if not curve:
        return None
    training = run.series("critic/score/mean")
    title = "validation (greedy)" + (" vs training reward (sampled)" if training else "")
    fig, (ax,) = _grid(title, 1, _iterations(run, curve))
    fig.set_size_inches(7.5, 4.0)
    for source, points in curve.items():
        _plot(ax, points, f"validation {source}")
        for component, component_points in _validation_components(run, source).items():
            _plot(ax, component_points, f"{source} {component}", linestyle=":")
    _plot(ax, training, "training critic/score/mean", color="grey", linestyle="--")
    ax.set_ylabel("mean score")
    ax.legend(fontsize=8)
    return fig


def _validation_components(run: RunData, source: str) -> dict[str, list[tuple[int, float]]]:
    """Each reward component's validation mean (val-aux/<source>/<component>/mean@n: GSM8K's
    correctness, and format, the rate of answers in the "#### N" form) when the score has more than one."""
    prefix = f"val-aux/{source}/"
    components = {
        match[1]: run.series(name)
        for name in run.metrics
        if name.startswith(prefix) and (match := _COMPONENT_MEAN.fullmatch(name[len(prefix) :]))
    }
    components.pop("reward", None)  # the score itself, already drawn
    return dict(sorted(components.items())) if len(components) > 1 else {}


_COMPONENT_MEAN = re.compile(r"([^/]+)/mean@\d+")


def timings_panel(run: RunData) -> Figure | None:
    """verl's timers (timing_s/gen, …) stacked; timing_s/step (the stages' sum) as a line on top."""
    stages = sorted(m for m in run.metrics if m.startswith("timing_s/") and m != "timing_s/step")
    if not stages:
        return None
    iters = sorted({i for m in stages for i in run.metrics[m]})
    fig, (ax,) = _grid("seconds per stage (stacked)", 1, iters)
    fig.set_size_inches(7.5, 4.0)
    stacks = [[run.metrics[m].get(i, 0.0) for i in iters] for m in stages]
    labels = [m.removeprefix("timing_s/") for m in stages]
    if len(iters) > 1:
        ax.stackplot(iters, stacks, labels=labels, alpha=0.8)
    else:  # a stackplot over one x is a zero-width area: draw a stacked bar
        bottom = 0.0
        for (height,), label in zip(stacks, labels, strict=True):
            ax.bar(iters, [height], bottom=bottom, width=0.5, label=label, alpha=0.8)
            bottom += height
    _plot(ax, run.series("timing_s/step"), "step (total)", color="black", linewidth=1)
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


PANELS: dict[str, Callable[[RunData, dict], Figure | None]] = {
    "actor": lambda run, _curve: actor_panel(run),
    "critic": lambda run, _curve: critic_panel(run),
    "rewards": lambda run, _curve: rewards_panel(run),
    "validation": validation_panel,
    "timings": lambda run, _curve: timings_panel(run),
}


def panel_figures(run_dir: str | Path) -> dict[str, Figure]:
    """Panel name -> figure, for the panels the run has data for (no critic panel without a critic)."""
    run, curve = load_run(run_dir, require_metrics=False), validation_curve(run_dir)
    if not validation_only(run):  # a validation-only run still has its validation panel
        require_iteration(run_dir, run)
    figures = {name: draw(run, curve) for name, draw in PANELS.items()}
    return {name: fig for name, fig in figures.items() if fig is not None}


def write_report(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """RUN_DIR/report/<panel>.png (or under `out`) and report.md; returns the written paths. Each file
    is written to a temp file and renamed: a link or FIFO planted at its name is replaced, and the
    default folder is never a link (it would put the report elsewhere)."""
    run_dir = Path(run_dir)
    if out is None:
        out = run_dir / "report"
        try:
            refuse_links_below(run_dir, out)
        except OSError as error:
            hint = f"{error.strerror}, or write the report elsewhere with --out"
            raise OSError(error.errno, hint, error.filename) from None
    out = Path(out)
    figures = panel_figures(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures.items():
        # Constrained layout sizes the margins for the tick labels of the previous draw: the first
        # draw settles the ticks (they depend on the axes' size), the second lays out the final ones.
        fig.canvas.draw()
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=100)
        write_bytes_atomic(out / f"{name}.png", image.getvalue())
        written.append(out / f"{name}.png")
    charts = "\n".join(f"![{name}]({name}.png)" for name in figures)
    missing = [name for name in PANELS if name not in figures]
    note = f"\n\nNo data for: {', '.join(missing)}." if missing else ""
    write_text_atomic(out / "report.md", f"{summary_markdown(run_dir)}\n### Charts\n\n{charts}{note}\n")
    return [*written, out / "report.md"]


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _validation_section(curve: dict[str, list[tuple[int, float]]]) -> list[str]:
    if not curve:
        return ["**Validation**: none recorded (trainer.test_freq, trainer.val_before_train)."]
    sources = sorted(curve)
    by_iter = {source: dict(points) for source, points in curve.items()}
    iters = sorted({i for points in curve.values() for i, _ in points})
    lines = []
    for source in sources:
        scores = [v for _, v in curve[source]]
        best_iter, best = max(curve[source], key=lambda p: p[1])
        lines.append(
            f"**Validation** `{source}`: {_fmt(scores[0])} → {_fmt(scores[-1])} (best {_fmt(best)} at "
            f"iteration {best_iter}) `{sparkline(scores)}`"
        )
    lines += ["", "| iteration | " + " | ".join(sources) + " |", "|---:|" + "---:|" * len(sources)]
    for i in iters:
        cells = [_fmt(by_iter[s][i]) if i in by_iter[s] else "" for s in sources]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return lines


def _metrics_section(run: RunData) -> list[str]:
    trained = run.trained_iterations()
    if not trained and validation_only(run):
        return _validation_metrics_section(run)
    if not trained:
        return ["**Final metrics**: no training step has finished."]
    last = trained[-1]
    lines = [f"**Final metrics** (iteration {last})", "", "| metric | value |", "|---|---:|"]
    for metric in HEADLINE_METRICS:
        if last in run.metrics.get(metric, {}):
            lines.append(f"| `{metric}` | {_fmt(run.metrics[metric][last])} |")
    return lines


def _validation_metrics_section(run: RunData) -> list[str]:
    """A validation-only run's metrics row: its val-core metrics (every one: `ppoflow query`)."""
    last = max((i for series in run.metrics.values() for i in series), default=None)
    core = sorted(
        name for name, series in run.metrics.items() if name.startswith("val-core/") and last in series
    )
    if not core:
        return [
            "**Validation metrics**: none recorded; a validation-only run (trainer.val_only) trains nothing."
        ]
    lines = [
        f"**Validation metrics** (iteration {last}; a validation-only run, trainer.val_only, trains nothing)",
        "",
        "| metric | value |",
        "|---|---:|",
    ]
    return lines + [f"| `{name}` | {_fmt(run.metrics[name][last])} |" for name in core]


def _findings_section(run: RunData) -> list[str]:
    if not run.trained_iterations():
        return []
    findings = diagnose(run)
    if not findings:
        return ["**Diagnose**: no findings, nothing looks wrong."]
    lines = [f"**Diagnose**: {len(findings)} finding(s) (`ppoflow diagnose` for the evidence)", ""]
    for f in findings:
        lines.append(f"- **{f.severity}** `{f.check}`: {f.title}")
        lines += [f"  - change `{key}`: {what}" for key, what in f.config_keys.items()]
    return lines


def _data_section(run_dir: Path, example_query: str) -> list[str]:
    actors = saved_folders(run_dir / "checkpoints", "actor")
    lines = [
        "**Where the data is**",
        "",
        f"- run directory: `{run_dir}` (parquet per stage under `iter=NNNNNN/`)",
        f'- DuckDB catalog: `{run_dir / "catalog.duckdb"}`; try `ppoflow query {run_dir} "{example_query}"`',
    ]
    if actors:
        lines.append(f"- final actor checkpoint (Hugging Face format): `{actors[-1]}`")
    lines.append(f"- charts: `ppoflow report {run_dir}` writes PNGs to `{run_dir / 'report'}`")
    return lines


def summary_markdown(run_dir: Path) -> str:
    """A markdown summary of a run directory: validation curve (table and sparkline), final metrics,
    diagnose findings, and where the data is. Works on any run directory with a catalog."""
    run_dir = Path(run_dir).resolve()
    run = load_run(run_dir, require_metrics=False)
    iterations = len(run.trained_iterations())
    estimator, model = (
        run.setting("algorithm.adv_estimator", "?"),
        run.setting("actor_rollout_ref.model.path", "?"),
    )
    head = f"### ppoflow run `{run_dir.name}`\n\n{iterations} iteration(s), `{estimator}`, model `{model}`"
    sections = [
        [head],
        _validation_section(validation_curve(run_dir)),
        _metrics_section(run),
        _findings_section(run),
        _data_section(run_dir, VALIDATION_QUERY if validation_only(run) else EXAMPLE_QUERY),
    ]
    return "\n\n".join("\n".join(s) for s in sections if s) + "\n"
