"""What a request to `ppoflow explore` may ask: which samples a page lists (SampleFilter), checked
before any of it reaches a query, and the error said to the page when the run cannot answer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ppoflow.tasks.storage.tables import MAX_STEP

__all__ = ["ExplorerError", "SampleFilter", "check_kind", "check_step"]

KINDS = ("train", "val")
SORTABLE = ("score", "response_length", "prompt_id", "sample_idx", "data_source", "finish_reason")
MAX_PAGE_ROWS = 200
MAX_PAGE = 10**7


class ExplorerError(ValueError):
    """A request the run cannot answer (an unknown iteration, a bad filter): said to the page."""


@dataclass(frozen=True)
class SampleFilter:
    """Which samples a page lists; every value is bound as a parameter."""

    kind: str = "train"
    iteration: int = 0
    data_source: str | None = None
    min_score: float | None = None
    max_score: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    truncated: bool | None = None
    sort: str = "score"
    descending: bool = False
    page: int = 0
    page_rows: int = 50

    def checked(self) -> SampleFilter:
        check_kind(self.kind)
        if self.sort not in SORTABLE:
            raise ExplorerError(f"sort must be one of {', '.join(SORTABLE)}, not {self.sort!r}")
        if not 1 <= self.page_rows <= MAX_PAGE_ROWS:
            raise ExplorerError(f"page_rows must be 1–{MAX_PAGE_ROWS}, not {self.page_rows}")
        if not 0 <= self.page <= MAX_PAGE:
            raise ExplorerError(f"page must be 0–{MAX_PAGE:,}, not {self.page}")
        check_step(self.iteration)
        for name in ("min_score", "max_score"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ExplorerError(f"{name} must be a finite number, not {value}")
        return self


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ExplorerError(f"kind must be one of {', '.join(KINDS)}, not {kind[:40]!r}")


def check_step(step: int) -> None:
    if not 0 <= step <= MAX_STEP:
        raise ExplorerError(f"iteration must be 0–{MAX_STEP:,}, not {str(step)[:40]}")
