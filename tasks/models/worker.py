"""One rank of a worker group: a process (a Ray actor) that keeps its shard of each trained model
(actor, critic), their optimizer state, a whole copy of the actor for generation and the frozen
reference, resident across stages and iterations. `workers.WorkerGroupHost` drives the ranks;
every method here is called on all ranks at once, since updates and sharded forward passes are
collectives."""

from __future__ import annotations

import copy
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ppoflow.engine.batching import ForwardBatching
from ppoflow.engine.forward import SequenceBatch, compute_values
from ppoflow.engine.models import load_actor, load_critic, load_reference
from ppoflow.engine.names import RolloutEngineName
from ppoflow.engine.optim import OptimSettings, build_optimizer
from ppoflow.engine.parallel import (
    DeepSpeedStepper,
    FSDP2Stepper,
    all_max,
    deepspeed_engine,
    full_state_dict,
    join_process_group,
    open_rendezvous,
    shard_fsdp2,
)
from ppoflow.engine.ppo import Rollouts
from ppoflow.engine.rollout import RolloutOutput, SamplingParams
from ppoflow.engine.vllm_rollout import VLLMOptions
from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.models.generation import RolloutEngines, generate_share, rollout_share
from ppoflow.tasks.models.ray_cluster import where_am_i
from ppoflow.tasks.models.replay import run_update
from ppoflow.tasks.models.tokenizer_cache import RecentTokenizers
from ppoflow.tasks.pipeline.placement import MultiTurnRequest, RoleLayout, RolloutRequest
from ppoflow.tasks.pipeline.states import UpdateInputs
from ppoflow.tasks.storage.checkpoints import StateUnavailable
from ppoflow.tasks.storage.deepspeed_optimizer_state import load_deepspeed_optimizer, save_deepspeed_optimizer
from ppoflow.tasks.storage.optimizer_state import (
    OptimizerStateError,
    load_torch_optimizer,
    save_torch_optimizer,
)
from ppoflow.tasks.storage.regular_files import open_regular_file

if TYPE_CHECKING:
    from ppoflow.engine.update import UpdateResult


@dataclass
class _Trained:
    model: torch.nn.Module  # the FSDP2 module, or the DeepSpeed engine
    layout: RoleLayout
    optimizer: torch.optim.Optimizer | None = None  # None: loaded for inference only
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    stepper: FSDP2Stepper | DeepSpeedStepper | None = None
    architecture: type | None = None  # the transformers class, to build a whole copy from gathered weights
    config: object = None
    engine: bool = False  # `model` is a DeepSpeed engine

    @property
    def module(self) -> torch.nn.Module:
        """The transformers model itself (inside the DeepSpeed engine, or the FSDP2 module)."""
        return self.model.module if self.engine else self.model

    def whole_copy(self) -> torch.nn.Module:
        """A fresh, unsharded model of the same architecture (its weights are set afterwards)."""
        return self.architecture(self.config)


class ModelWorker:
    """Rank `rank` of `world`. It joins the group's process group when told where: rank 0 opens the
    rendezvous (`open_rendezvous`), then every rank joins it (`join_group`)."""

    def __init__(self, rank: int, world: int, device: str, threads: int | None):
        if threads:
            torch.set_num_threads(threads)
        self.rank, self.world, self.device = rank, world, device
        self._listener: socket.socket | None = None  # rank 0's, until the group is joined
        self._trained: dict[str, _Trained] = {}
        self._generator: torch.nn.Module | None = None  # a whole copy of the actor, for generation
        self._generator_version = 0  # counts the actor states the copy has held
        self._engines = RolloutEngines(in_process_group=True)
        self._reference: dict[str, torch.nn.Module] = {}
        self._tokenizers = RecentTokenizers()

    def open_rendezvous(self, host: str | None) -> tuple[str, int] | None:
        """Rank 0: listen for the process group's store on `host` (None: this node's address in the
        cluster) at a port the kernel picks; returns (address, port). The other ranks: None."""
        if self.rank != 0:
            return None
        address = host or where_am_i()[2]
        self._listener = open_rendezvous(address)
        return address, self._listener.getsockname()[1]

    def join_group(self, master_addr: str, master_port: int) -> None:
        """Join the process group at rank 0's rendezvous (`open_rendezvous`)."""
        listener, self._listener = self._listener, None
        join_process_group(self.rank, self.world, master_addr, master_port, self.device, listener)

    def pid(self) -> int:
        return os.getpid()

    def place(self) -> tuple[int, str, str, str | None]:
        """Where this rank runs (`ray_cluster.RankPlace`)."""
        return where_am_i()

    def probe(self, directory: str) -> str:
        """Write and read back a file in the run directory: every rank must see the same storage."""
        path = Path(directory) / f".probe-rank{self.rank}-{os.getpid()}"
        descriptor = open_regular_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # a new file, no link
        with os.fdopen(descriptor, "w") as stream:
            stream.write(str(self.rank))
        try:
            return path.read_text()
        finally:
            path.unlink(missing_ok=True)

    def load(
        self,
        role: str,
        directory: str,
        optimizer_directory: str | None,
        layout: RoleLayout,
        optim: OptimSettings | None,
    ) -> None:
        """Load the model saved in `directory` (an HF model) as this rank's shard of `role`; to train
        it (`optim`), with an optimizer holding the state in `optimizer_directory` (saved at any world
        size; None: a fresh optimizer). Without `optim` it is loaded for inference only."""
        model = load_critic(directory) if role == "critic" else load_actor(directory)
        model = model.to(self.device)
        if role == "actor" and not _whole_on_every_rank(layout):
            self._generator = copy.deepcopy(model).eval()
        trained = self._wrap(model, layout, optim)
        if optimizer_directory is not None:
            load = load_deepspeed_optimizer if layout.strategy == "deepspeed" else load_torch_optimizer
            try:
                load(Path(optimizer_directory), trained.model, trained.optimizer, trained.scheduler)
            except OptimizerStateError as error:
                raise StateUnavailable(str(error)) from error
        self._trained[role] = trained
        if role == "actor":
            self._sync_generator()

    def _wrap(self, model: torch.nn.Module, layout: RoleLayout, optim: OptimSettings | None) -> _Trained:
        architecture, config = type(model), model.config
        if layout.strategy == "deepspeed":
            if optim is None and layout.zero_stage < 3:  # whole weights on every rank: the model itself
                return _Trained(model, layout, architecture=architecture, config=config)
            optimizer, scheduler = build_optimizer(model, optim) if optim is not None else (None, None)
            engine = deepspeed_engine(
                model,
                optimizer,
                zero_stage=layout.zero_stage,
                micro_batch_size=layout.micro_batch_size,
                micro_batches=layout.micro_batches,
                grad_clip=layout.grad_clip,
                offload_optimizer=layout.offload_optimizer,
            )
            if optimizer is None:  # ZeRO-3 for inference: its parameters partitioned over the ranks
                return _Trained(engine, layout, architecture=architecture, config=config, engine=True)
            stepper = DeepSpeedStepper(engine, optimizer)
            return _Trained(engine, layout, optimizer, scheduler, stepper, architecture, config, engine=True)
        model = shard_fsdp2(model, self.device)
        if optim is None:
            return _Trained(model, layout, architecture=architecture, config=config)
        optimizer, scheduler = build_optimizer(model, optim)
        stepper = FSDP2Stepper(model, optimizer)
        return _Trained(model, layout, optimizer, scheduler, stepper, architecture, config)

    def _full_weights(self, role: str) -> dict[str, torch.Tensor]:
        trained = self._trained[role]
        if trained.layout.strategy == "deepspeed" and not trained.engine:  # not wrapped: whole weights
            return {k: v.detach().clone() for k, v in trained.model.state_dict().items()}
        return full_state_dict(trained.model, trained.layout.strategy, trained.layout.zero_stage)

    def _sync_generator(self) -> None:
        """Refresh the whole copy of the actor that generates (verl's weight sync from the trainer
        to the rollout engine). ZeRO-1/2 keep whole weights on every rank: the engine's module is
        used directly."""
        trained = self._trained["actor"]
        if _whole_on_every_rank(trained.layout):
            self._generator = trained.module
        else:
            self._generator.load_state_dict(self._full_weights("actor"))
        self._generator_version += 1

    def _engine(
        self, tokenizer_dir: str, name: RolloutEngineName, batch_size: int | None, vllm: VLLMOptions | None
    ):
        return self._engines.engine(
            name,
            self._generator,
            self.tokenizer(tokenizer_dir),
            batch_size=batch_size,
            vllm=vllm,
            model_dir=tokenizer_dir,
            version=self._generator_version,
        )

    def tokenizer(self, directory: str):
        return self._tokenizers.get(directory)

    def reference(self, lineage: str, directory: str) -> torch.nn.Module:
        if lineage not in self._reference:
            self._reference[lineage] = load_reference(directory).to(self.device)
        return self._reference[lineage]

    def rollouts(
        self,
        tokenizer_dir: str,
        reference: tuple[str, str] | None,
        prompt_ids: list[list[int]],
        first_prompt: int,
        request: RolloutRequest,
    ) -> Rollouts:
        """This rank's share of a step's rollouts: prompts from `first_prompt` on of the batch."""
        ref_model = self.reference(*reference) if reference is not None else None
        # every rank, also one without prompts: starting a vLLM engine in a group is a collective
        engine = self._engine(tokenizer_dir, request.engine, request.generation_batch_size, request.vllm)
        return rollout_share(
            engine,
            self._generator,
            ref_model,
            self.tokenizer(tokenizer_dir),
            prompt_ids,
            request,
            first_prompt=first_prompt,
        )

    def generate(
        self,
        tokenizer_dir: str,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        engine: RolloutEngineName,
        batch_size: int | None,
        vllm: VLLMOptions | None = None,
        multi_turn: MultiTurnRequest | None = None,
    ) -> RolloutOutput:
        generator = self._engine(tokenizer_dir, engine, batch_size, vllm)  # every rank (a collective)
        if not prompt_ids:
            return RolloutOutput()
        tokenizer = self.tokenizer(tokenizer_dir)
        return generate_share(generator, tokenizer, prompt_ids, sampling, seeds, multi_turn)

    def values(self, batch: SequenceBatch, batching: ForwardBatching) -> torch.Tensor:
        """V(s_t) of this rank's rows (every rank has as many, so the sharded forward passes pair up)."""
        return compute_values(self._trained["critic"].model, batch, batching=batching, agree=all_max)

    def train(self, run_dir: str, role: str, inputs: UpdateInputs, tokenizer_dir: str) -> UpdateResult | None:
        """One update of `role` on this rank's share of each mini-batch; rank 0 returns the
        metrics (summed over the ranks)."""
        trained = self._trained[role]
        if trained.optimizer is None:
            raise RuntimeError(
                f"the {role} was loaded for inference only: load it with its optimizer to train it"
            )

        def after_step(_: int) -> None:  # a fault point inside the update, where a rank can die
            inject_fault(f"{role}_update_rank{self.rank}", inputs.step)

        result = run_update(
            run_dir,
            role,
            inputs,
            trained.model,
            trained.optimizer,
            trained.scheduler,
            self.tokenizer(tokenizer_dir).pad_token_id,
            stepper=trained.stepper,
            on_step=after_step,
        )
        if role == "actor":
            self._sync_generator()
        return result if self.rank == 0 else None

    def save(self, role: str, directory: str, optimizer_directory: str) -> None:
        """Rank 0 writes the whole model (an HF directory, gathered from every rank); every rank
        writes its part of the optimizer state (collectives: every rank calls this)."""
        trained = self._trained[role]
        weights = self._full_weights(role)
        save = save_deepspeed_optimizer if trained.layout.strategy == "deepspeed" else save_torch_optimizer
        save(Path(optimizer_directory), trained.model, trained.optimizer, trained.scheduler)
        if self.rank == 0:
            whole = trained.whole_copy()
            whole.load_state_dict(weights)
            whole.save_pretrained(directory)


def _whole_on_every_rank(layout: RoleLayout) -> bool:
    """ZeRO-1/2 shard optimizer state and gradients only: every rank holds the whole weights."""
    return layout.strategy == "deepspeed" and layout.zero_stage < 3
