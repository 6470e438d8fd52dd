"""Steps of an earlier start that the run's last start does not continue.

A start that trains to step N with another config than the start before leaves that start's steps
after N on disk, trained from a step N that is no longer the run's: queries, `diagnose`, `report` and
`export` would take them for the run's. They are moved, not deleted, to `superseded/<time>/` (their
`iter=k/` folders) and `checkpoints/superseded/<time>/`, where nothing reads them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ppoflow.tasks.storage.regular_files import refuse_links_below
from ppoflow.tasks.storage.tables import step_of

SUPERSEDED = "superseded"


def steps_after(run_dir: Path, last: int) -> list[int]:
    """The steps after `last` that have a folder in the run: their tables (`iter=k/`) or their
    checkpoints (`checkpoints/iter=k/`)."""
    found = {step_of(p.name) for p in run_dir.glob("iter=*")}
    found |= {step_of(p.name) for p in run_dir.glob("checkpoints/iter=*")}
    return sorted(step for step in found if step is not None and step > last)


def set_aside_steps(run_dir: Path, steps: list[int]) -> str:
    """Move the folders of `steps` to superseded/<UTC time>/ (their tables) and
    checkpoints/superseded/<UTC time>/ (their checkpoints: on the same disk, should checkpoints/ be a
    link to another); returns the <UTC time> folder name. A step folder that is a link is moved as
    the link. Every target is checked before anything moves: a link planted on the way raises
    OSError with nothing moved."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    bases = (run_dir, run_dir / "checkpoints")
    while any((base / SUPERSEDED / stamp).exists() for base in bases):  # two starts in one second
        stamp += "+"
    moves = [
        (base / f"iter={step:06d}", base / SUPERSEDED / stamp / f"iter={step:06d}")
        for step in steps
        for base in bases
        if os.path.lexists(base / f"iter={step:06d}")
    ]
    for _, target in moves:
        refuse_links_below(target.parent.parent.parent, target.parent)
    for source, target in moves:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(source, target)
    return stamp
