"""Where a run's models live while it trains, in this process: the `ModelPlacement` of a run of world
size 1 (`placement.place_models`), reached as `run.models`.

Stages hand each other `ModelState` references; the host turns a reference into a model. It keeps
the newest trained state of each role in memory, so consecutive stages never reload weights, and
the frozen reference policy once; a state it does not hold (a resumed run, a stage served from
cache) comes from its intact checkpoint, or is rebuilt by replaying the updates since the last one.
Stages ask the host for what they need computed (rollouts, values, an update, a checkpoint), so the
same stages drive `workers.WorkerGroupHost`, which keeps the models sharded over worker processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ppoflow.engine.batching import ForwardBatching
from ppoflow.engine.forward import SequenceBatch, compute_scores, compute_values
from ppoflow.engine.lora import AdaptersOff, LoraSpec, add_adapters, load_adapters
from ppoflow.engine.models import load_actor, load_critic, load_reference, load_reward_model, load_tokenizer
from ppoflow.engine.names import RolloutEngineName
from ppoflow.engine.optim import OptimSettings, build_optimizer
from ppoflow.engine.ppo import Rollouts
from ppoflow.engine.rollout import RolloutEngine, RolloutOutput, SamplingParams
from ppoflow.engine.vllm_rollout import VLLMOptions
from ppoflow.tasks.models.generation import RolloutEngines, generate_share, rollout_share
from ppoflow.tasks.models.replay import run_update
from ppoflow.tasks.models.tokenizer_cache import RecentTokenizers
from ppoflow.tasks.observe.console import say
from ppoflow.tasks.pipeline.model_files import load_optimizer_state, model_dir, save_checkpoint, verified_dir
from ppoflow.tasks.pipeline.placement import MultiTurnRequest, RolloutRequest
from ppoflow.tasks.pipeline.states import ModelState, UpdateHistory, UpdateInputs
from ppoflow.tasks.storage.checkpoints import StateUnavailable, Trainable, directory_digest

if TYPE_CHECKING:
    from ppoflow.engine.update import UpdateResult
    from ppoflow.tasks.pipeline.run import RunFiles


def saved_tokenizer_dir(run: RunFiles, state: ModelState, history: UpdateHistory) -> Path:
    """The checkpoint directory of `state`, or of its nearest ancestor whose checkpoint is there (a
    pruned or deleted one is not; `history` knows the ancestors of a state handed on without them),
    or of a LoRA state's base: the tokenizer there is the state's (training never changes it, and
    every checkpoint of whole weights carries the base model's)."""
    while state.base is None:
        if state.checkpoint is not None and model_dir(run, state).is_dir():
            break
        origin = history.origin_of(state)
        if origin is None:
            break
        state = origin.parent
    return model_dir(run, state.base or state)


class ModelHost:
    """The models of one run, on `device` ("cpu" or "cuda"; batches follow the model)."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._live: dict[str, tuple[str, Trainable]] = {}  # role → (lineage, its trainable)
        self._reference: dict[str, torch.nn.Module] = {}  # lineage → frozen policy
        self._tokenizers = RecentTokenizers()  # checkpoint directory → tokenizer
        self._trained: dict[str, Trainable] = {}  # role → trained by `train`, not yet kept
        self._reward_models: dict[str, tuple[torch.nn.Module, object]] = {}  # digest → model, tokenizer
        self._engines = RolloutEngines()
        self.history = UpdateHistory()

    def start(self, run: RunFiles) -> None:
        """Nothing to start: models are loaded in this process when first asked for."""

    def rollouts(
        self,
        run: RunFiles,
        actor: ModelState,
        reference: ModelState | None,
        prompt_ids: list[list[int]],
        request: RolloutRequest,
        progress=None,
    ) -> Rollouts:
        """rollout.n responses per prompt of a step's batch, with old and reference log-probs."""
        model, tokenizer = self.model(run, actor), self.tokenizer(run, actor)
        engine = self._engine(run, actor, request.engine, request.generation_batch_size, request.vllm)
        return rollout_share(
            engine,
            model,
            self.reference_for(run, actor, model, reference),
            tokenizer,
            prompt_ids,
            request,
            on_batch=progress,
            on_tokens=getattr(progress, "tokens", None),
        )

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
        progress=None,
        multi_turn: MultiTurnRequest | None = None,
    ) -> RolloutOutput:
        """One response per prompt (validation), response i sampled from `seeds[i]`."""
        if not prompt_ids:
            return RolloutOutput()
        generator = self._engine(run, actor, engine, batch_size, vllm)
        return generate_share(
            generator,
            self.tokenizer(run, actor),
            prompt_ids,
            sampling,
            seeds,
            multi_turn,
            on_batch=progress,
            on_tokens=getattr(progress, "tokens", None),
        )

    def _engine(
        self,
        run: RunFiles,
        actor: ModelState,
        name: RolloutEngineName,
        batch_size: int | None,
        vllm: VLLMOptions | None,
    ) -> RolloutEngine:
        return self._engines.engine(
            name,
            self.model(run, actor),
            self.tokenizer(run, actor),
            batch_size=batch_size,
            vllm=vllm,
            model_dir=str(saved_tokenizer_dir(run, actor, self.history)),
            version=actor.lineage,
        )

    def values(self, run: RunFiles, critic: ModelState, batch: SequenceBatch, *, batching: ForwardBatching):
        """V(s_t) of every response token of `batch` (N, T)."""
        return compute_values(self.model(run, critic), batch, batching=batching)

    def reward_scores(self, path: str, digest: str, batch: SequenceBatch, *, micro_batch_size: int):
        """The reward model's score of every (prompt, response) row of `batch` (N,)."""
        return compute_scores(self._reward_model(path, digest)[0], batch, micro_batch_size=micro_batch_size)

    def reward_tokenizer(self, path: str, digest: str):
        """The reward model's tokenizer."""
        return self._reward_model(path, digest)[1]

    def _reward_model(self, path: str, digest: str) -> tuple[torch.nn.Module, object]:
        """The reward model at `path`, loaded once, after checking its files still have `digest` (the
        identity its stage's cache key names)."""
        if digest not in self._reward_models:
            if directory_digest(Path(path)) != digest:
                raise StateUnavailable(
                    f"the reward model at {path} (reward_model.model.path) changed while the run was open "
                    "(digest mismatch): run the same command again to score with its new weights"
                )
            self._reward_models[digest] = (self._placed(load_reward_model(path)), load_tokenizer(path))
        return self._reward_models[digest]

    def train(self, run: RunFiles, role: str, inputs: UpdateInputs, on_step=None) -> UpdateResult:
        """Apply one update to the parent state of `inputs` (in place); `keep` names the result,
        `drop` discards it."""
        value = self.trainable(run, inputs.parent, inputs.optim, inputs.lora)
        self._live.pop(role, None)  # no longer the parent state, whatever happens next
        self._trained[role] = value
        return self._update(run, role, inputs, value, on_step)

    def _update(
        self, run: RunFiles, role: str, inputs: UpdateInputs, value: Trainable, on_step=None
    ) -> UpdateResult:
        pad_token_id = self.tokenizer(run, inputs.parent).pad_token_id
        optimizer, scheduler = value.optimizer, value.scheduler
        return run_update(
            run.path,
            role,
            inputs,
            value.model,
            optimizer,
            scheduler,
            pad_token_id,
            on_step=on_step,
            clock=run.io,
        )

    def save(
        self,
        run: RunFiles,
        role: str,
        step: int,
        tokenizer,
        base: ModelState | None = None,
        lora: LoraSpec | None = None,
    ) -> tuple[str, str, str]:
        """Save what `train` produced: checkpoints/iter=N/<role>/ (its adapters only, for a LoRA
        state of `base`) and <role>.optim/; (directory, its digest, the optimizer state's digest)."""
        value = self._trained[role]
        return save_checkpoint(run, role, step, value, tokenizer, base=base, lora=lora, clock=run.io)

    def close(self) -> None:
        """Shut down a vLLM engine (the models go with the process)."""
        self._engines.close()

    def trainable(
        self, run: RunFiles, state: ModelState, optim: OptimSettings, lora: LoraSpec | None = None
    ) -> Trainable:
        """The model, optimizer and LR schedule of `state`, to train: in memory, else from its intact
        checkpoint (the optimizer built with `optim`, its saved state restored; new `lora` adapters
        on a base model), else rebuilt by replaying its update on its (recursively rebuilt) parent;
        StateUnavailable when none is possible."""
        live = self._live_value(state)
        if live is not None:
            return live
        try:
            value = self._load(run, state, optim, lora)
        except StateUnavailable as missing:
            inputs = self.history.origin_of(state)
            if inputs is None:
                raise
            try:
                value = self.trainable(run, inputs.parent, optim, inputs.lora)
            except StateUnavailable as error:
                raise StateUnavailable(f"{missing}, and it cannot be rebuilt: {error}") from error
            say(f"rebuilding the {state.role} of step {state.step} by replaying its update: {missing}")
            self._update(run, state.role, inputs, value)
        self.keep(state, value)
        return value

    def model(self, run: RunFiles, state: ModelState) -> torch.nn.Module:
        """The model of `state` for inference: in memory, else its intact checkpoint, else rebuilt by
        replaying the updates since the last intact checkpoint."""
        live = self._live_value(state)
        if live is not None:
            return live.model
        try:
            directory = verified_dir(run, state)
        except StateUnavailable:
            inputs = self.history.origin_of(state)
            if inputs is None:
                raise
            return self.trainable(run, state, inputs.optim, inputs.lora).model
        return self._placed(self._read(run, state, directory))

    def reference_for(
        self, run: RunFiles, actor: ModelState, model: torch.nn.Module, reference: ModelState | None
    ) -> torch.nn.Module | None:
        """The reference policy beside `actor` (its `model`): the actor itself while it is the
        reference (the first step), its adapters-off view when it is a LoRA state of the reference
        (verl's ref_in_actor: the base weights are held once), else the frozen copy."""
        if reference is None:
            return None
        if actor.lineage == reference.lineage:
            return model
        if actor.base is not None and actor.base.lineage == reference.lineage:
            return AdaptersOff(model)
        return self.reference(run, reference)

    def reference(self, run: RunFiles, state: ModelState) -> torch.nn.Module:
        """The frozen reference policy (the initial actor), loaded once per run."""
        if state.lineage not in self._reference:
            self._reference[state.lineage] = self._placed(load_reference(model_dir(run, state)))
        return self._reference[state.lineage]

    def tokenizer(self, run: RunFiles, state: ModelState):
        """The tokenizer saved with `state`, or with its nearest saved ancestor (training never
        changes the tokenizer, and every checkpoint carries the base model's)."""
        return self._tokenizers.get(str(saved_tokenizer_dir(run, state, self.history)))

    def keep(self, state: ModelState, value: Trainable | None = None) -> None:
        """Hold `value` (by default what `train` produced for the role) as the newest state of its
        role (the previous one is released)."""
        value = value if value is not None else self._trained.pop(state.role)
        self._live[state.role] = (state.lineage, value)

    def drop(self, role: str) -> None:
        """Release the model of `role` (after a failed update left it half-trained)."""
        self._live.pop(role, None)
        self._trained.pop(role, None)

    def _live_value(self, state: ModelState) -> Trainable | None:
        live = self._live.get(state.role)
        return live[1] if live is not None and live[0] == state.lineage else None

    def _load(
        self, run: RunFiles, state: ModelState, optim: OptimSettings, lora: LoraSpec | None
    ) -> Trainable:
        directory = verified_dir(run, state)
        model = self._read(run, state, directory, trainable=True)
        if lora is not None and state.base is None:
            if state.step > 0:
                raise ValueError(
                    f"the {state.role} of step {state.step} holds whole weights: LoRA adapters are "
                    "trained on the base model only"
                )
            model = add_adapters(model, lora, value_head=state.role == "critic")
        model = self._placed(model)
        optimizer, scheduler = build_optimizer(model, optim)
        if state.step > 0:
            load_optimizer_state(run, state, model, optimizer, scheduler)
        return Trainable(model, optimizer, scheduler)

    def _read(self, run: RunFiles, state: ModelState, directory: Path, *, trainable: bool = False):
        """The weights of `state` from its verified `directory`: a whole model, or its base with the
        adapters saved there (trainable or frozen)."""
        if state.base is None:
            return load_critic(directory) if state.role == "critic" else load_actor(directory)
        base = self._read(run, state.base, verified_dir(run, state.base))
        return load_adapters(base, directory, trainable=trainable)

    def _placed(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)
