"""Worker groups on Ray: a run whose world size (trainer.nnodes × trainer.n_gpus_per_node) is above 1
keeps its models in `world` worker processes (Ray actors, `worker.ModelWorker`), one per device,
joined in one torch.distributed process group. Stages stay Prefect tasks in the driver: each asks
this host for rollouts, values, an update or a checkpoint, and the host sends every rank its share.

Ray is started for the run on loopback without a dashboard, or joined at `RAY_ADDRESS` for a
cluster; a worker that dies fails the stage within seconds with the rank
named, and the group is torn down (no worker outlives the run).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ppoflow.engine.forward import SequenceBatch
from ppoflow.engine.names import RolloutEngineName
from ppoflow.engine.ppo import Rollouts
from ppoflow.engine.rollout import RolloutOutput, SamplingParams
from ppoflow.engine.update import UpdateResult
from ppoflow.engine.vllm_rollout import VLLMOptions
from ppoflow.tasks.models.generation import RolloutRequest
from ppoflow.tasks.models.host import saved_tokenizer_dir
from ppoflow.tasks.models.reaper import reap_after_exit
from ppoflow.tasks.models.replay import UpdateHistory
from ppoflow.tasks.models.tokenizer_cache import RecentTokenizers
from ppoflow.tasks.models.worker import RoleLayout
from ppoflow.tasks.observe.console import say
from ppoflow.tasks.storage.checkpoints import (
    StateUnavailable,
    verified_dir,
    verified_optimizer_dir,
    write_checkpoint,
)
from ppoflow.tasks.storage.states import ModelState, UpdateInputs

if TYPE_CHECKING:
    from ppoflow.tasks.run import Run


class WorkerFailed(RuntimeError):
    """A rank of the worker group died or raised; the group has been stopped."""


@dataclass(frozen=True)
class GroupPlan:
    world_size: int
    device: str
    ray_address: str | None = None
    num_threads: int | None = None


class WorkerGroup:
    """`plan.world_size` ModelWorker actors in one process group."""

    def __init__(self, plan: GroupPlan):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ppoflow.tasks.models.worker import ModelWorker

        self.plan = plan
        address = plan.ray_address or os.environ.get("RAY_ADDRESS")
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            if address:
                _check_reachable(address)
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            else:
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private, loopback-only instance
                ray.init(
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    num_cpus=max(plan.world_size, os.cpu_count() or 1),
                    num_gpus=torch.cuda.device_count() if plan.device == "cuda" else 0,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
        gpu = 1 if plan.device == "cuda" else 0
        _require_resources(plan, "GPU" if gpu else "CPU", self)
        bundle = {"CPU": 1, "GPU": gpu} if gpu else {"CPU": 1}
        self._group = placement_group([bundle] * plan.world_size, strategy="PACK")
        ray.get(self._group.ready(), timeout=120)
        master_addr = "127.0.0.1" if not address else _node_address(self._group)
        port = _free_port() if not address else _remote_free_port(self._group)
        remote = ray.remote(ModelWorker)
        self._workers = [
            remote.options(
                num_cpus=1,
                num_gpus=gpu,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank
                ),
            ).remote(rank, plan.world_size, master_addr, port, plan.device, plan.num_threads)
            for rank in range(plan.world_size)
        ]
        self.pids = self.call("pid", what="start-up")
        if self._own_ray and not address:
            reap_after_exit(os.getpid())

    def call(self, method: str, *args, what: str, per_rank: list[tuple] | None = None) -> list:
        """Run `method` on every rank (rank r with `per_rank[r]` when given, else `args`) and return
        the ranks' results; the first rank to fail stops the group and raises WorkerFailed naming it."""
        import ray

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
                self.close()
                rank = rank_of[ready[0]]
                pid = self.pids[rank] if getattr(self, "pids", None) else None
                raise WorkerFailed(
                    f"worker rank {rank} of {len(refs)} failed during {what}: {_first_line(error, pid)}"
                ) from None
        return ray.get(refs)

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for worker in getattr(self, "_workers", []):
            ray.kill(worker, no_restart=True)
        self._workers = []
        if getattr(self, "_group", None) is not None:
            ray.util.remove_placement_group(self._group)
            self._group = None
        if self._own_ray:
            ray.shutdown()


def _require_resources(plan: GroupPlan, kind: str, group: WorkerGroup) -> None:
    """One worker per device: a cluster with fewer free devices than the world size would leave
    the placement waiting; say so at once."""
    import ray

    available = int(ray.available_resources().get(kind, 0))
    if available < plan.world_size:
        group.close()
        device = "GPUs" if kind == "GPU" else "CPUs"
        raise WorkerFailed(
            f"world_size={plan.world_size} (trainer.nnodes × trainer.n_gpus_per_node) needs "
            f"{plan.world_size} free {device} in the Ray cluster, which has {available}"
            + ("; on a machine without GPUs use trainer.device=cpu" if kind == "GPU" else "")
        )


class WorkerGroupHost:
    """The models of a run with world size > 1: the same questions as `host.ModelHost`, answered
    by a worker group. Which state each role holds is tracked here (by lineage), as ModelHost does."""

    def __init__(self, plan: GroupPlan):
        self.plan = plan
        self.device = plan.device
        self._group: WorkerGroup | None = None
        self._layouts: dict[str, RoleLayout] = {}
        self._live: dict[str, str] = {}  # role → lineage its workers hold
        self._tokenizers = RecentTokenizers()
        self.history = UpdateHistory()

    def start(self, run: Run) -> None:
        """Start the workers and check that every rank reads and writes the run directory."""
        if self._group is not None:
            return
        self._group = WorkerGroup(self.plan)
        seen = self._group.call("probe", str(run.path), what="the run-directory check")
        if seen != [str(rank) for rank in range(self.plan.world_size)]:
            raise WorkerFailed(
                f"the workers do not all see {run.path}: put the run directory on storage every node mounts"
            )

    def assign(self, layouts: dict[str, RoleLayout]) -> None:
        """How each trained role is spread over the ranks (known once the run's settings are)."""
        self._layouts = dict(layouts)

    @property
    def group(self) -> WorkerGroup:
        if self._group is None:
            raise RuntimeError("the worker group is not started (WorkerGroupHost.assign)")
        return self._group

    def tokenizer(self, run: Run, state: ModelState):
        return self._tokenizers.get(str(saved_tokenizer_dir(run, state, self.history)))

    def _ensure(self, run: Run, state: ModelState, what: str) -> None:
        """Make the workers hold `state`: already held, else its intact checkpoint (with its optimizer
        state, since the workers train what they hold), else replayed."""
        role = state.role
        if self._live.get(role) == state.lineage:
            return
        self._live.pop(role, None)
        try:
            directory = verified_dir(run, state)
            optimizer = str(verified_optimizer_dir(run, state)) if state.step > 0 else None
        except StateUnavailable as missing:
            inputs = self.history.origin_of(state)
            if inputs is None:
                raise
            self._ensure(run, inputs.parent, what)
            say(f"rebuilding the {role} of step {state.step} by replaying its update: {missing}")
            self._train(run, role, inputs, what)
        else:
            self.group.call(
                "load", role, str(directory), optimizer, self._layouts[role], what=f"{what} (loading)"
            )
        self._live[role] = state.lineage

    def rollouts(
        self,
        run: Run,
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
        run: Run,
        actor: ModelState,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        *,
        engine: RolloutEngineName,
        batch_size: int | None,
        vllm: VLLMOptions | None = None,
        progress=None,
    ) -> RolloutOutput:
        self._ensure(run, actor, "validation")
        tokenizer_dir = str(saved_tokenizer_dir(run, actor, self.history))
        starts = _share_starts(len(prompt_ids), self.plan.world_size)
        per_rank = [
            (tokenizer_dir, prompt_ids[a:b], sampling, seeds[a:b], engine, batch_size, vllm)
            for a, b in zip(starts, starts[1:], strict=False)
        ]
        out = RolloutOutput()
        for share in self.group.call("generate", what="validation", per_rank=per_rank):
            out.extend(share)
        if progress is not None:
            progress(len(prompt_ids))
        return out

    def values(
        self, run: Run, critic: ModelState, batch: SequenceBatch, *, micro_batch_size: int
    ) -> torch.Tensor:
        """Values in equal shares (the last rows repeated to fill the last share), since every rank
        must take part in each sharded forward pass."""
        self._ensure(run, critic, "advantages")
        world, n = self.plan.world_size, len(batch)
        size = -(-n // world)
        rows = torch.arange(size * world).clamp(max=n - 1)
        per_rank = [(batch.select(rows[r * size : (r + 1) * size]), micro_batch_size) for r in range(world)]
        parts = self.group.call("values", what="advantages (critic values)", per_rank=per_rank)
        return torch.cat(parts)[:n]

    def train(self, run: Run, role: str, inputs: UpdateInputs, on_step=None) -> UpdateResult:
        if inputs.lora is not None or inputs.parent.base is not None:  # the config refuses it first
            raise ValueError(f"LoRA trains in one process: a worker group cannot train the {role}'s adapters")
        self._ensure(run, inputs.parent, f"{role}_update")
        self._live.pop(role, None)  # trained in place: no longer the parent state
        result = self._train(run, role, inputs, f"{role}_update")
        if on_step is not None:
            on_step(len(result.steps))
        return result

    def _train(self, run: Run, role: str, inputs: UpdateInputs, what: str) -> UpdateResult:
        tokenizer_dir = str(saved_tokenizer_dir(run, inputs.parent, self.history))
        results = self.group.call(
            "train", str(run.path), role, inputs, tokenizer_dir, what=f"{what} (step {inputs.step})"
        )
        return results[0]

    def save(self, run: Run, role: str, step: int, tokenizer, base=None, lora=None) -> tuple[str, str, str]:
        """Rank 0 writes the whole model (gathered), every rank its part of the optimizer state,
        this process the tokenizer, into the checkpoint being staged."""

        def fill(directory, optimizer_directory) -> None:
            self.group.call("save", role, str(directory), str(optimizer_directory), what=f"{role} checkpoint")
            tokenizer.save_pretrained(directory)

        return write_checkpoint(run, role, step, fill, clock=run.io)

    def keep(self, state: ModelState, value=None) -> None:
        self._live[state.role] = state.lineage

    def drop(self, role: str) -> None:
        self._live.pop(role, None)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


def _share_starts(n: int, world: int) -> list[int]:
    """Boundaries of `world` contiguous shares of n items (sizes differ by at most one)."""
    return [rank * n // world for rank in range(world + 1)]


def _joined_rollouts(shares: list[Rollouts], starts: list[int]) -> Rollouts:
    joined = Rollouts([], [], [], [], [], [], None if shares[0].ref_log_probs is None else [], {})
    for share, start in zip(shares, starts, strict=False):
        joined.prompt_index += [start + i for i in share.prompt_index]
        joined.sample_index += share.sample_index
        joined.response_ids += share.response_ids
        joined.finish_reasons += share.finish_reasons
        joined.rollout_log_probs += share.rollout_log_probs
        joined.old_log_probs += share.old_log_probs
        if joined.ref_log_probs is not None:
            joined.ref_log_probs += share.ref_log_probs
        for phase, seconds in share.seconds.items():  # the ranks run at once: the slowest counts
            joined.seconds[phase] = max(joined.seconds.get(phase, 0.0), seconds)
    return joined


def _first_line(error: BaseException, pid: int | None) -> str:
    """One line for a rank's failure: the exception it raised, or that its process died."""
    from ray.exceptions import RayActorError

    if isinstance(error, RayActorError):
        process = f"its process (pid {pid})" if pid else "its process"
        return f"{process} died (killed, crashed or out of memory); Ray's logs: /tmp/ray/session_latest/logs"
    cause = getattr(error, "cause", None) or error
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}".strip()


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_address(group) -> str:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    task = ray.remote(num_cpus=0)(lambda: ray.util.get_node_ip_address())
    return ray.get(task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote())


def _remote_free_port(group) -> int:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    task = ray.remote(num_cpus=0)(_free_port_any)
    return ray.get(task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote())


def _free_port_any() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
