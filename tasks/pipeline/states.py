"""What stages hand each other: model-state references and stage results (small, JSON-able; never
data). The run handle is `tasks/pipeline/run.py`."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ppoflow.tasks.storage.tables import ArtifactRef

if TYPE_CHECKING:  # types only: a stage's cache key hashes the code it runs (cache_keys.py)
    from ppoflow.engine.lora import LoraSpec
    from ppoflow.engine.optim import OptimSettings
    from ppoflow.engine.update import ActorUpdateSettings, CriticUpdateSettings

ROLES = ("actor", "critic")


@dataclass(frozen=True)
class ModelState:
    """One version of a trained model. `lineage` hashes the parent state's lineage and what it was
    updated on (DESIGN.md "Identity"); `checkpoint` is its directory relative to the run (absolute for
    a base model used in place), `checkpoint_digest` the digest of that directory (weights, config,
    tokenizer) and `optimizer_digest` the digest of the optimizer state saved beside it, when saved;
    `origin` is the update that produced it, so a state that was not saved (or whose
    files were lost) can be rebuilt by replaying that update from its parent. A LoRA state names its
    `base`, the role's step-0 state its adapters apply to: its checkpoint holds the adapters only."""

    role: str
    lineage: str
    step: int
    checkpoint: str | None
    checkpoint_digest: str | None = None
    origin: UpdateInputs | None = None
    optimizer_digest: str | None = None
    base: ModelState | None = None

    def __post_init__(self) -> None:
        # A state read back from a run directory names paths to write (checkpoints/iter=k/<role>):
        # nothing in it may lead out of the run.
        if self.role not in ROLES:
            raise ValueError(f"model state role must be one of {ROLES}, got {self.role!r}")
        if self.checkpoint is not None and ".." in Path(self.checkpoint).parts:
            raise ValueError(f"model state checkpoint {self.checkpoint!r} leads out of the run")

    def detached(self) -> ModelState:
        """This state without its replay history (a saved parent need not carry its own)."""
        return dataclasses.replace(self, origin=None)


@dataclass(frozen=True)
class UpdateInputs:
    """Everything an update stage consumed: enough to replay it bit for bit."""

    parent: ModelState
    step: int
    rollouts: ArtifactRef
    advantages: ArtifactRef
    settings: ActorUpdateSettings | CriticUpdateSettings
    optim: OptimSettings
    lora: LoraSpec | None = None
    """The adapters to add when the parent is a base model (LoRA); None trains every weight."""


@dataclass(frozen=True)
class TrainState:
    """What one iteration hands the next: model states and the KL coefficient β."""

    actor: ModelState
    critic: ModelState | None
    reference: ModelState | None
    kl_coef: float


@dataclass(frozen=True)
class StageResult:
    """What a stage task returns through Prefect: references and small numbers, never data."""

    stage: str
    refs: tuple[ArtifactRef, ...]
    cache_key: str
    seconds: float
    values: tuple[tuple[str, float], ...] = ()

    def value(self, name: str) -> float:
        return dict(self.values)[name]

    @property
    def ref(self) -> ArtifactRef:
        return self.refs[0]


class StageTimer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


TIMING_PREFIX = "timing_s/"


def timing_values(seconds: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """A stage's phase timings as StageResult values, named by verl's timers (timing_s/gen, …)."""
    return tuple(sorted((TIMING_PREFIX + name, float(value)) for name, value in seconds.items()))


@dataclass(frozen=True)
class StepResults:
    """The results of one training step's stages, in DAG order (None: the stage did not run)."""

    rollouts: StageResult
    reward_model: StageResult | None
    rewards: StageResult
    advantages: StageResult
    critic_update: StageResult | None
    actor_update: StageResult | None
    validation: StageResult | None

    def finished(self) -> list[StageResult]:
        return [r for r in (getattr(self, f.name) for f in dataclasses.fields(self)) if r is not None]


class UpdateHistory:
    """The update that produced each model state this run has seen, by lineage. A state handed on
    after its checkpoint was saved carries no history (the checkpoint stands in for it), but once its
    optimizer state is pruned (only the newest checkpoints keep one) the checkpoint cannot be trained
    on: the state is then rebuilt by replaying its update from its parent, and so on back to a state
    that can be loaded, at worst the base model. The flow remembers every update stage's state, cached
    or computed, so that chain is known."""

    def __init__(self) -> None:
        self._origins: dict[str, UpdateInputs] = {}

    def remember(self, state: ModelState | None) -> None:
        while state is not None and state.origin is not None and state.lineage not in self._origins:
            self._origins[state.lineage] = state.origin
            state = state.origin.parent

    def origin_of(self, state: ModelState) -> UpdateInputs | None:
        """The update that produced `state`; None for a base model (or a state never seen)."""
        return state.origin or self._origins.get(state.lineage)
