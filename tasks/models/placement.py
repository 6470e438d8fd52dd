"""The placement a run's plan asks for: the models in this process (`host.ModelHost`), or, with a
world size above 1, sharded over a worker group on Ray (`workers.WorkerGroupHost`). Both answer
`pipeline.placement.ModelPlacement`, and nothing else tells them apart: a type checker holds both
to it at `place_models`' returns (tests/test_types.py)."""

from __future__ import annotations

from ppoflow.tasks.pipeline.placement import ModelPlacement, PlacementPlan


def place_models(plan: PlacementPlan) -> ModelPlacement:
    """The placement for `plan`, not started yet (`open_run` starts it once the run is locked)."""
    if plan.world_size > 1:
        from ppoflow.tasks.models.workers import WorkerGroupHost  # Ray is imported only when used

        return WorkerGroupHost(plan)
    from ppoflow.tasks.models.host import ModelHost

    return ModelHost(plan.device)
