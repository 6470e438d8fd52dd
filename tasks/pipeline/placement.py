"""Where a run's models live, as the stages see it: every question a stage asks of them is a method
of `ModelPlacement`, and the placement is built once per run from a `PlacementPlan` (the device,
the world size, each trained role's layout over the ranks). Two placements implement it:
`tasks/models/host.py` (this process) and `tasks/models/workers.py` (a worker group on Ray, world
size > 1); `tasks/models/placement.py` picks one. A type checker holds both to this protocol
(tests/test_types.py).

What depends on the data (the LR schedule's horizon) is not in the plan: it reaches a placement
with each update (`UpdateInputs.optim`), the one route optimizer settings take.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ppoflow.tasks.pipeline.states import ModelState, UpdateHistory, UpdateInputs

if TYPE_CHECKING:
    import torch

    from ppoflow.engine.batching import ForwardBatching
    from ppoflow.engine.forward import SequenceBatch
    from ppoflow.engine.lora import LoraSpec
    from ppoflow.engine.multi_turn import MultiTurnLimits
    from ppoflow.engine.names import RolloutEngineName
    from ppoflow.engine.ppo import Rollouts
    from ppoflow.engine.rollout import RolloutOutput, SamplingParams
    from ppoflow.engine.tools import ToolContext
    from ppoflow.engine.update import UpdateResult
    from ppoflow.engine.vllm_rollout import VLLMOptions
    from ppoflow.tasks.pipeline.run import RunFiles

Strategy = Literal["fsdp2", "deepspeed"]


@dataclass(frozen=True)
class ToolSpec:
    """One tool of multi_turn.tool_config_path: its name (the schema's function name), its class,
    verl's `config` and `tool_schema`. A user's class is `attribute` of the Python file
    `module_file` (where the file is: not in the key), whose bytes' digest is `source_digest` (an
    edited tool is a cache miss); a built-in one (engine/tools.py) has neither."""

    name: str
    class_name: str
    schema: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    module_file: str | None = field(default=None, metadata={"cache_key": False})
    attribute: str | None = None
    source_digest: str | None = None

    @property
    def builtin(self) -> bool:
        return self.module_file is None


@dataclass(frozen=True)
class MultiTurnSettings:
    """actor_rollout_ref.rollout.multi_turn with enable=true: the loop's limits, the tools and the
    time one call may take."""

    limits: MultiTurnLimits
    tools: tuple[ToolSpec, ...]
    tool_timeout_s: float


@dataclass(frozen=True)
class MultiTurnRequest:
    """A step's multi-turn rollouts: the settings, the tools' context of each prompt of the step's
    batch (its ground truth and extra_info), and whether the prompts are chat messages (a tool turn
    is then rendered by the chat template)."""

    settings: MultiTurnSettings
    contexts: tuple[ToolContext, ...]
    chat: bool


@dataclass(frozen=True)
class RolloutRequest:
    """One step's generation, as the rollouts stage asks for it (actor_rollout_ref.rollout.*)."""

    engine: RolloutEngineName
    n: int
    sampling: SamplingParams
    seed: int
    """The step's sampling seed; response j of prompt i samples from sample_seed(seed, i, j)."""
    generation_batch_size: int | None
    """rollout.micro_batch_size: responses generated together on one device (None with vLLM)."""
    log_prob_batching: ForwardBatching
    ref_log_prob_batching: ForwardBatching
    recompute_old_log_probs: bool = True
    """False: the engine's log-probs are the old log-probs (rollout_correction.bypass_mode)."""
    sum_pi_squared: bool = False
    """Also keep Σπ² of each token from the old-log-prob pass (the optimal token baselines)."""
    share_prompts: bool = False
    """actor.use_prefix_grouper: a prompt's responses share its forward pass in the log-prob passes."""
    vllm: VLLMOptions | None = None
    """The vLLM engine's options (rollout.name=vllm)."""
    multi_turn: MultiTurnRequest | None = None
    """Multi-turn rollouts with tools (rollout.multi_turn.enable); None: one turn."""


@dataclass(frozen=True)
class RoleLayout:
    """How one trained role (actor or critic) is spread over a worker group's ranks."""

    strategy: Strategy
    """fsdp2 (verl's fsdp is run as fsdp2) or deepspeed."""
    zero_stage: int
    offload_optimizer: bool
    micro_batch_size: int
    """ppo_micro_batch_size_per_gpu."""
    micro_batches: int
    """Micro-batches per rank in one mini-batch (DeepSpeed's gradient accumulation steps)."""
    grad_clip: float


@dataclass(frozen=True)
class PlacementPlan:
    """Where a run's models live: `device` (trainer.device), and with a world size above 1 the
    worker group's shape and each trained role's layout."""

    device: str = "cpu"
    world_size: int = 1
    nnodes: int = 1
    """trainer.nnodes: the ranks run on this many distinct nodes, world_size / nnodes on each."""
    num_threads: int | None = None
    """trainer.num_threads of each rank (None: torch's choice)."""
    layouts: Mapping[str, RoleLayout] = field(default_factory=dict)
    """role → its layout (actor, and critic when the estimator needs one)."""
    ray_address: str | None = None
    """A Ray cluster to join (else RAY_ADDRESS, else a Ray of the run's own)."""

    @property
    def per_node(self) -> int:
        return self.world_size // self.nnodes

    def describe(self) -> str:
        return (
            f"world_size={self.world_size} (trainer.nnodes={self.nnodes} × "
            f"trainer.n_gpus_per_node={self.per_node})"
        )


class ModelPlacement(Protocol):
    """Every question a stage asks of where the run's models live. Stages hand each other
    `ModelState` references; a placement turns a reference into a model (held in memory, loaded from
    its intact checkpoint, or rebuilt by replaying the updates since one) and answers with numbers."""

    device: str
    history: UpdateHistory
    """The update that produced each model state this run has seen (to rebuild one by replay)."""

    def start(self, run: RunFiles) -> None:
        """Be ready to answer: a worker group starts its workers and checks they all see the run."""
        ...

    def tokenizer(self, run: RunFiles, state: ModelState):
        """The tokenizer saved with `state` (or with its nearest saved ancestor)."""
        ...

    def rollouts(
        self,
        run: RunFiles,
        actor: ModelState,
        reference: ModelState | None,
        prompt_ids: list[list[int]],
        request: RolloutRequest,
        progress: Callable | None = None,
    ) -> Rollouts:
        """rollout.n responses per prompt of a step's batch, with old and reference log-probs."""
        ...

    def generate(
        self,
        run: RunFiles,
        actor: ModelState,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        *,
        engine: RolloutEngineName,
        batch_size: int | None,
        vllm: VLLMOptions | None = None,
        progress: Callable | None = None,
        multi_turn: MultiTurnRequest | None = None,
    ) -> RolloutOutput:
        """One response per prompt (validation), response i sampled from `seeds[i]`."""
        ...

    def values(
        self, run: RunFiles, critic: ModelState, batch: SequenceBatch, *, batching: ForwardBatching
    ) -> torch.Tensor:
        """V(s_t) of every response token of `batch` (N, T)."""
        ...

    def reward_scores(
        self, path: str, digest: str, batch: SequenceBatch, *, micro_batch_size: int
    ) -> torch.Tensor:
        """The reward model's score of every (prompt, response) row of `batch` (N,)."""
        ...

    def reward_tokenizer(self, path: str, digest: str):
        """The reward model's tokenizer."""
        ...

    def train(
        self, run: RunFiles, role: str, inputs: UpdateInputs, on_step: Callable[[int], None] | None = None
    ) -> UpdateResult:
        """Apply one update to the parent state of `inputs` (in place): `keep` names the result,
        `drop` discards it."""
        ...

    def save(
        self,
        run: RunFiles,
        role: str,
        step: int,
        tokenizer,
        base: ModelState | None = None,
        lora: LoraSpec | None = None,
    ) -> tuple[str, str, str]:
        """Save what `train` produced: (checkpoint directory, its digest, the optimizer state's)."""
        ...

    def keep(self, state: ModelState) -> None:
        """Hold what `train` produced as `state`, the newest state of its role."""
        ...

    def drop(self, role: str) -> None:
        """Release the model of `role` (after a failed update left it half-trained)."""
        ...

    def close(self) -> None:
        """Release everything (workers, engines); the placement answers nothing after."""
        ...
