"""What `ppoflow diagnose` reads and reports: a run's metrics, raw-row statistics and config
(RunData), the Findings its checks return, and the helpers the checks share to build their evidence."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}
LR = "actor_rollout_ref.actor.optim.lr"
VALIDATION_METRICS = ("val-core/", "val-aux/")
"""The prefixes of validation's metrics (verl's names)."""


@dataclass(frozen=True)
class Evidence:
    """A metric (or config key) and its values at the iterations that matter (no iterations for a
    config value)."""

    metric: str
    iters: tuple[int, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class Finding:
    check: str
    severity: Severity
    title: str
    evidence: tuple[Evidence, ...]
    causes: tuple[str, ...]
    config_keys: dict[str, str] = field(default_factory=dict)
    """verl key -> what to do with it (current value first where known)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunData:
    """What the checks read. metrics: metrics-table column -> {iter: value} (finite values only);
    rows: a statistic of the raw rows ("rewards/score_std", …) -> {iter: value}; config: config.yaml."""

    metrics: dict[str, dict[int, float]]
    rows: dict[str, dict[int, float]]
    config: dict[str, Any]
    window: tuple[int, int] | None = None
    """(the first step read, the steps with metrics in the run) when only the newest were read."""

    def series(self, name: str) -> list[tuple[int, float]]:
        """(iter, value) in iteration order, from the metrics table, else from the raw rows."""
        return sorted((self.metrics.get(name) or self.rows.get(name) or {}).items())

    def trained_iterations(self) -> list[int]:
        """The iterations that trained, in order: a metrics row with a metric other than validation's
        (the row of a step that only validates, before training or in a validation-only run, has only
        val-core/… and val-aux/… metrics)."""
        trained = (series for name, series in self.metrics.items() if not name.startswith(VALIDATION_METRICS))
        return sorted({i for series in trained for i in series})

    def setting(self, key: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return default if node is None else node

    def advise(self, changes: dict[str, str]) -> dict[str, str]:
        """verl key -> "current → what to do" (just what to do when the key is unset)."""
        return {k: w if self.setting(k) is None else f"{self.setting(k)} → {w}" for k, w in changes.items()}


Points = list[tuple[int, float]]
"""(iter, value) in iteration order, as RunData.series returns them."""


def values_of(points: Points) -> list[float]:
    return [v for _, v in points]


def evidence_of(metric: str, points: Points) -> Evidence:
    return Evidence(metric, tuple(i for i, _ in points), tuple(float(f"{v:.6g}") + 0.0 for _, v in points))


def settings_evidence(run: RunData, *keys: str) -> tuple[Evidence, ...]:
    return tuple(Evidence(k, (), (run.setting(k),)) for k in keys if run.setting(k) is not None)


def fitted_change(points: Points) -> float:
    """Least-squares slope × span of the iterations: how much the series moved, robust to one noisy end."""
    if len(points) < 2:
        return 0.0
    xs, ys = [float(i) for i, _ in points], values_of(points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope * (xs[-1] - xs[0])
