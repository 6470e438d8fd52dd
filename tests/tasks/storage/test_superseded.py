"""Moving an earlier start's later steps aside: links moved as links, and nothing moved when a link
is planted where they would go."""

from __future__ import annotations

import os

import pytest

from ppoflow.tasks.storage.superseded import SUPERSEDED, set_aside_steps, steps_after


def _run(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2, 3):
        (run / f"iter={step:06d}").mkdir(parents=True)
        (run / f"iter={step:06d}/_manifest.json").write_text("{}")
    elsewhere = tmp_path / "bigger-disk/iter=000003"
    (elsewhere / "actor").mkdir(parents=True)
    (run / "checkpoints/iter=000002/actor").mkdir(parents=True)
    os.symlink(elsewhere, run / "checkpoints/iter=000003")  # one step's checkpoint on another disk
    return run, elsewhere


def test_later_steps_move_with_their_checkpoints_and_a_linked_one_moves_as_the_link(tmp_path):
    run, elsewhere = _run(tmp_path)
    assert steps_after(run, 1) == [2, 3]
    stamp = set_aside_steps(run, [2, 3])
    assert sorted(p.name for p in run.glob("iter=*")) == ["iter=000001"]
    assert sorted(p.name for p in (run / SUPERSEDED / stamp).iterdir()) == ["iter=000002", "iter=000003"]
    moved_link = run / "checkpoints" / SUPERSEDED / stamp / "iter=000003"
    assert moved_link.is_symlink() and moved_link.resolve() == elsewhere and (elsewhere / "actor").is_dir()
    assert not list((run / "checkpoints").glob("iter=*"))
    assert steps_after(run, 1) == []


def test_a_link_planted_where_they_would_go_moves_nothing(tmp_path):
    run, _ = _run(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, run / "checkpoints" / SUPERSEDED)
    with pytest.raises(OSError, match="link"):
        set_aside_steps(run, [2, 3])
    assert steps_after(run, 1) == [2, 3] and list(outside.iterdir()) == []
    assert not (run / SUPERSEDED).exists() or not any((run / SUPERSEDED).iterdir())
