"""Worker groups on Ray: a run whose world size (trainer.nnodes × trainer.n_gpus_per_node) is above 1
keeps its models in `world` worker processes (Ray actors, `worker.ModelWorker`), one per device,
joined in one torch.distributed process group. Stages stay Prefect tasks in the driver: each asks
this host for rollouts, values, an update or a checkpoint, and the host sends every rank its share.

Ray is started for the run on loopback without a dashboard, its files in a folder of the run's own
(reaper.py), or joined at `RAY_ADDRESS` for a cluster (ray_cluster.py: trainer.nnodes distinct
nodes); a worker or node that dies fails the stage within seconds with the rank and its node
named, and the group is torn down (no worker outlives the run).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ppoflow.engine.batching import ForwardBatching
from ppoflow.engine.forward import SequenceBatch
from ppoflow.engine.names import RolloutEngineName
from ppoflow.engine.optim import OptimSettings
from ppoflow.engine.ppo import Rollouts
from ppoflow.engine.rollout import RolloutOutput, SamplingParams
from ppoflow.engine.vllm_rollout import VLLMOptions
from ppoflow.tasks.models.host import saved_tokenizer_dir
from ppoflow.tasks.models.ray_cluster import (
    RankPlace,
    WorkerFailed,
    dead_rank,
    keep_ray_on_loopback,
    nodes_gone,
    on_loopback,
    place_workers,
)
from ppoflow.tasks.models.reaper import private_ray_dir, reap_after_exit, remove_ray_dir, stop_processes
from ppoflow.tasks.models.tokenizer_cache import RecentTokenizers
from ppoflow.tasks.observe.console import say
from ppoflow.tasks.pipeline.model_files import verified_dir, verified_optimizer_dir
from ppoflow.tasks.pipeline.placement import MultiTurnRequest, PlacementPlan, RolloutRequest
from ppoflow.tasks.pipeline.states import ModelState, UpdateHistory, UpdateInputs
from ppoflow.tasks.storage.checkpoints import StateUnavailable, write_checkpoint

if TYPE_CHECKING:
    from ppoflow.engine.update import UpdateResult
    from ppoflow.tasks.pipeline.run import RunFiles

logger = logging.getLogger(__name__)


DEAD_PEER_GRACE_S = 15.0
"""How long a rank's error waits for Ray to report a dead rank (see WorkerGroup.call)."""


class WorkerGroup:
    """`plan.world_size` ModelWorker actors in one process group, on a Ray this group starts on
    loopback (its files in a folder of its own, removed on close) or on the cluster at RAY_ADDRESS
    (whose files are left alone), trainer.nnodes distinct nodes of it."""

    def __init__(self, plan: PlacementPlan):
        import ray

        self.plan = plan
        self.address = plan.ray_address or os.environ.get("RAY_ADDRESS")
        self.ray_dir: str | None = None  # Ray's files, when this group started Ray
        self.places: list[RankPlace] = []
        self._ray_processes: dict[int, int] = {}
        self._workers: list = []
        self._group = None
        self._own_ray = not ray.is_initialized()
        try:
            if self._own_ray:
                self._start_ray()
            self._start_workers()
        except BaseException:
            self.close()
            raise

    def _start_ray(self) -> None:
        import ray

        if self.address:
            _check_reachable(self.address)
            if on_loopback(self.address):
                keep_ray_on_loopback()
            ray.init(address=self.address, log_to_driver=False, logging_level=logging.WARNING)
            return
        if self.plan.nnodes > 1:
            raise WorkerFailed(
                f"{self.plan.describe()} asks for {self.plan.nnodes} nodes, but without RAY_ADDRESS "
                f"ppoflow starts Ray on this machine alone, one node: set trainer.nnodes=1 "
                f"trainer.n_gpus_per_node={self.plan.world_size} to run the ranks here, or join a "
                f"cluster of {self.plan.nnodes} nodes with RAY_ADDRESS=<head address>:<port>"
            )
        keep_ray_on_loopback()
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private, loopback-only instance
        os.environ.setdefault("AUTOSCALER_METRIC_PORT", "0")  # its monitor's metrics: any free port
        self.ray_dir = private_ray_dir()
        ray.init(
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=self.ray_dir,
            num_cpus=max(self.plan.world_size, os.cpu_count() or 1),
            num_gpus=torch.cuda.device_count() if self.plan.device == "cuda" else 0,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )

    def _start_workers(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ppoflow.tasks.models.worker import ModelWorker

        plan, gpu = self.plan, 1 if self.plan.device == "cuda" else 0
        self._group = place_workers(plan, self.address)
        remote = ray.remote(ModelWorker)
        self._workers = [
            remote.options(
                num_cpus=1,
                num_gpus=gpu,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank // plan.per_node
                ),
            ).remote(rank, plan.world_size, plan.device, plan.num_threads)
            for rank in range(plan.world_size)
        ]
        self.places = [RankPlace(*place) for place in self.call("place", what="start-up")]
        # This machine's own cluster: the group meets on loopback; a cluster's: at rank 0's node.
        rendezvous = self.call("open_rendezvous", None if self.address else "127.0.0.1", what="start-up")[0]
        self.call("join_group", *rendezvous, what="start-up")
        ranks = "; ".join(f"rank {rank} {place}" for rank, place in enumerate(self.places))
        logger.info("worker group%s: %s", f" (Ray's files in {self.ray_dir})" if self.ray_dir else "", ranks)
        if self.ray_dir:
            self._ray_processes = reap_after_exit(os.getpid(), self.ray_dir)

    def call(self, method: str, *args, what: str, per_rank: list[tuple] | None = None) -> list:
        """Run `method` on every rank (rank r with `per_rank[r]` when given, else `args`) and return
        the ranks' results; the first rank to fail stops the group and raises WorkerFailed naming it.
        A rank whose peer died in a collective fails at once (gloo: connection reset), before Ray
        reports the dead one (some 4 s later when its whole node is gone): a rank Ray reports dead,
        or whose node no longer answers, within DEAD_PEER_GRACE_S is named as the cause instead."""
        import ray
        from ray.exceptions import RayActorError

        refs = [
            getattr(worker, method).remote(*(per_rank[rank] if per_rank is not None else args))
            for rank, worker in enumerate(self._workers)
        ]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except Exception as error:  # the other ranks would wait for it in a collective
                rank = rank_of[ready[0]]
                if not isinstance(error, RayActorError):
                    rank, error = dead_rank(pending, rank_of, self.places, DEAD_PEER_GRACE_S) or (rank, error)
                said = self._said(rank, error)
                self.close()
                raise WorkerFailed(
                    f"worker rank {rank} of {len(refs)} failed during {what}: {said}"
                ) from None
        return ray.get(refs)

    def _said(self, rank: int, error: BaseException | None) -> str:
        """One line for a rank's failure: the exception it raised (`_first_line`), or that its
        process died or its node is gone (error None), where it ran, and Ray's logs there when the
        cluster is not this run's own."""
        from ray.exceptions import RayActorError

        place = self.places[rank] if rank < len(self.places) else None
        if error is not None and (place is None or not isinstance(error, RayActorError)):
            return _first_line(error, place.pid if place else None)
        logs = f"; Ray's logs there: {place.logs}" if place.logs and not self.ray_dir else ""
        if nodes_gone({place.node_id}):
            gone = f"its node {place.node_ip} ({place.node_id[:8]}) is gone (its raylet does not answer)"
            return f"{gone}, and pid {place.pid} with it{logs}"
        return f"its process ({place}) died (killed, crashed or out of memory){logs}"

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            for worker in self._workers:
                ray.kill(worker, no_restart=True)
            if self._group is not None:
                ray.util.remove_placement_group(self._group)
            if self._own_ray:
                ray.shutdown()
        self._workers, self._group = [], None
        if self.ray_dir:  # Ray's agents outlive its raylet by a moment; then its files can go
            stop_processes(self._ray_processes, grace_s=5.0)
            remove_ray_dir(self.ray_dir)
            self.ray_dir = None


class WorkerGroupHost:
    """The models of a run with world size > 1: the same questions as `host.ModelHost`, answered
    by a worker group. Which state each role holds is tracked here (by lineage), as ModelHost does."""

    def __init__(self, plan: PlacementPlan):
        self.plan = plan
        self.device = plan.device
        self._group: WorkerGroup | None = None
        self._live: dict[str, tuple[str, bool]] = {}  # role → (lineage its workers hold, with an optimizer)
        self._tokenizers = RecentTokenizers()
        self.history = UpdateHistory()

    def start(self, run: RunFiles) -> None:
        """Start the workers and check that every rank reads and writes the run directory."""
        if self._group is not None:
            return
        self._group = WorkerGroup(self.plan)
        seen = self._group.call("probe", str(run.path), what="the run-directory check")
        if seen != [str(rank) for rank in range(self.plan.world_size)]:
            raise WorkerFailed(
                f"the workers do not all see {run.path}: put the run directory on storage every node mounts"
            )

    @property
    def group(self) -> WorkerGroup:
        if self._group is None:
            raise RuntimeError("the worker group is not started (WorkerGroupHost.start)")
        return self._group

    def tokenizer(self, run: RunFiles, state: ModelState):
        return self._tokenizers.get(str(saved_tokenizer_dir(run, state, self.history)))

    def _ensure(
        self, run: RunFiles, state: ModelState, what: str, optim: OptimSettings | None = None
    ) -> None:
        """Make the workers hold `state`: already held, else its intact checkpoint, else replayed. To
        train it (`optim`, the update's optimizer settings) they hold its optimizer state too: a state
        loaded for inference only is loaded again with it."""
        role = state.role
        held = self._live.get(role)
        if held is not None and held[0] == state.lineage and (optim is None or held[1]):
            return
        self._live.pop(role, None)
        try:
            directory = verified_dir(run, state)
            trained = optim is not None and state.step > 0
            optimizer = str(verified_optimizer_dir(run, state)) if trained else None
        except StateUnavailable as missing:
            inputs = self.history.origin_of(state)
            if inputs is None:
                raise
            self._ensure(run, inputs.parent, what, inputs.optim)
            say(f"rebuilding the {role} of step {state.step} by replaying its update: {missing}")
            self._train(run, role, inputs, what)
            self._live[role] = (state.lineage, True)
            return
        layout = self.plan.layouts[role]
        self.group.call("load", role, str(directory), optimizer, layout, optim, what=f"{what} (loading)")
        self._live[role] = (state.lineage, optim is not None)

    def rollouts(
        self,
        run: RunFiles,
        actor: ModelState,
        reference: ModelState | None,
        prompt_ids: list[list[int]],
        request: RolloutRequest,
        progress=None,
    ) -> Rollouts:
        self._ensure(run, actor, "rollouts")
        tokenizer_dir = str(saved_tokenizer_dir(run, actor, self.history))
        ref = (reference.lineage, str(verified_dir(run, reference))) if reference is not None else None
        starts = _share_starts(len(prompt_ids), self.plan.world_size)
        per_rank = [
            (tokenizer_dir, ref, prompt_ids[start:stop], start, request)
            for start, stop in zip(starts, starts[1:], strict=False)
        ]
        shares = self.group.call("rollouts", what="rollouts", per_rank=per_rank)
        if progress is not None:
            progress(len(prompt_ids) * request.n)
        return _joined_rollouts(shares, starts)

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
        self._ensure(run, actor, "validation")
        tokenizer_dir = str(saved_tokenizer_dir(run, actor, self.history))
        starts = _share_starts(len(prompt_ids), self.plan.world_size)
        per_rank = [
            (
                tokenizer_dir,
                prompt_ids[a:b],
                sampling,
                seeds[a:b],
                engine,
                batch_size,
                vllm,
                None if multi_turn is None else replace(multi_turn, contexts=multi_turn.contexts[a:b]),
            )
            for a, b in zip(starts, starts[1:], strict=False)
        ]
        out = RolloutOutput()
        for share in self.group.call("generate", what="validation", per_rank=per_rank):
            out.extend(share)
        if progress is not None:
            progress(len(prompt_ids))
        return out

    def values(
        self, run: RunFiles, critic: ModelState, batch: SequenceBatch, *, batching: ForwardBatching
    ) -> torch.Tensor:
        """Values in equal shares (the last rows repeated to fill the last share), since every rank
        must take part in each sharded forward pass."""
        self._ensure(run, critic, "advantages")
        world, n = self.plan.world_size, len(batch)
        size = -(-n // world)
        rows = torch.arange(size * world).clamp(max=n - 1)
        per_rank = [(batch.select(rows[r * size : (r + 1) * size]), batching) for r in range(world)]
        parts = self.group.call("values", what="advantages (critic values)", per_rank=per_rank)
        return torch.cat(parts)[:n]

    def train(self, run: RunFiles, role: str, inputs: UpdateInputs, on_step=None) -> UpdateResult:
        if inputs.lora is not None or inputs.parent.base is not None:  # the config refuses it first
            raise ValueError(f"LoRA trains in one process: a worker group cannot train the {role}'s adapters")
        self._ensure(run, inputs.parent, f"{role}_update", inputs.optim)
        self._live.pop(role, None)  # trained in place: no longer the parent state
        result = self._train(run, role, inputs, f"{role}_update")
        if on_step is not None:
            on_step(len(result.steps))
        return result

    def _train(self, run: RunFiles, role: str, inputs: UpdateInputs, what: str) -> UpdateResult:
        tokenizer_dir = str(saved_tokenizer_dir(run, inputs.parent, self.history))
        results = self.group.call(
            "train", str(run.path), role, inputs, tokenizer_dir, what=f"{what} (step {inputs.step})"
        )
        return results[0]

    def save(
        self, run: RunFiles, role: str, step: int, tokenizer, base=None, lora=None
    ) -> tuple[str, str, str]:
        """Rank 0 writes the whole model (gathered), every rank its part of the optimizer state,
        this process the tokenizer, into the checkpoint being staged."""

        def fill(directory, optimizer_directory) -> None:
            self.group.call("save", role, str(directory), str(optimizer_directory), what=f"{role} checkpoint")
            tokenizer.save_pretrained(directory)

        return write_checkpoint(run.path, role, step, fill, clock=run.io)

    def reward_scores(self, path: str, digest: str, batch: SequenceBatch, *, micro_batch_size: int):
        raise ValueError(_REWARD_MODEL_IN_ONE_PROCESS)

    def reward_tokenizer(self, path: str, digest: str):
        raise ValueError(_REWARD_MODEL_IN_ONE_PROCESS)

    def keep(self, state: ModelState) -> None:
        self._live[state.role] = (state.lineage, True)

    def drop(self, role: str) -> None:
        self._live.pop(role, None)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


_REWARD_MODEL_IN_ONE_PROCESS = (
    "the reward model runs in the trainer's process, which holds no models when the world size is above 1 "
    "(the config refuses reward_model.enable there first)"
)


def _share_starts(n: int, world: int) -> list[int]:
    """Boundaries of `world` contiguous shares of n items (sizes differ by at most one)."""
    return [rank * n // world for rank in range(world + 1)]


def _joined_rollouts(shares: list[Rollouts], starts: list[int]) -> Rollouts:
    joined = Rollouts([], [], [], [], [], [], None if shares[0].ref_log_probs is None else [], {})
    joined.trajectories = None if shares[0].trajectories is None else []
    joined.sum_pi_squared = None if shares[0].sum_pi_squared is None else []
    for share, start in zip(shares, starts, strict=False):
        joined.prompt_index += [start + i for i in share.prompt_index]
        joined.sample_index += share.sample_index
        joined.response_ids += share.response_ids
        joined.finish_reasons += share.finish_reasons
        joined.rollout_log_probs += share.rollout_log_probs
        joined.old_log_probs += share.old_log_probs
        if joined.ref_log_probs is not None:
            joined.ref_log_probs += share.ref_log_probs
        if joined.trajectories is not None:
            joined.trajectories += share.trajectories or []
        if joined.sum_pi_squared is not None:
            joined.sum_pi_squared += share.sum_pi_squared or []
        for phase, seconds in share.seconds.items():  # the ranks run at once: the slowest counts
            joined.seconds[phase] = max(joined.seconds.get(phase, 0.0), seconds)
    return joined


def _check_reachable(address: str) -> None:
    """Joining a cluster that is not there makes Ray retry for minutes: check the address first."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" or "local": Ray looks for the cluster itself
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as error:
        raise WorkerFailed(
            f"no Ray cluster answers at RAY_ADDRESS={address} ({error.strerror or error}): start one "
            "there with `ray start --head`, or unset RAY_ADDRESS to run on this machine"
        ) from None


def _first_line(error: BaseException, pid: int | None, where: str = "") -> str:
    """One line for a rank's failure: the exception it raised, or that its process died."""
    from ray.exceptions import RayActorError

    if isinstance(error, RayActorError):
        process = f"its process (pid {pid}{where})" if pid else "its process"
        return f"{process} died (killed, crashed or out of memory)"
    cause = getattr(error, "cause", None) or error
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}".strip()
