"""What a worker group needs of Ray: to stay on loopback when it runs on this machine, nodes with
room for its ranks (trainer.nnodes of them, trainer.n_gpus_per_node ranks on each), the address its
ranks meet at, where each rank runs, and whether a rank's node is still there."""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass

from ppoflow.tasks.pipeline.placement import PlacementPlan

PLACEMENT_TIMEOUT_S = 120
RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class WorkerFailed(RuntimeError):
    """A rank of the worker group died or raised, or the group could not start; it has been stopped."""


@dataclass(frozen=True)
class RankPlace:
    """Where a rank runs: its process, its Ray node, and Ray's log folder there."""

    pid: int
    node_id: str
    node_ip: str
    logs: str | None

    def __str__(self) -> str:
        return f"pid {self.pid} on node {self.node_ip} ({self.node_id[:8]})"


def on_loopback(address: str) -> bool:
    host = address.removeprefix("ray://").rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def keep_ray_on_loopback() -> None:
    """Ray 2.60 replaces 127.0.0.1 by this machine's outward address wherever it meets it (ray.init's
    node address, a RAY_ADDRESS on 127.0.0.1), and its servers then listen on every interface. Its
    switch for one-machine clusters (on by default on Linux; read when Ray is imported, looked up
    when it resolves an address) keeps 127.0.0.1 as given and its servers on it alone. Turned off
    for this process and the Ray processes it starts."""
    os.environ[RAY_CLUSTER_SWITCH] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def place_workers(plan: PlacementPlan, address: str | None):
    """Reserve room for the ranks, one placement bundle per node (world_size / nnodes devices, and
    as many CPUs): STRICT_SPREAD puts the bundles on distinct nodes (verl asks for one placement
    group per node instead, which distinct nodes do not bind). Returns the placement group. (Rank 0
    opens the process group's rendezvous on its node itself: worker.ModelWorker.open_rendezvous.)"""
    import ray
    from ray.util.placement_group import placement_group

    gpu = plan.device == "cuda"
    bundle = {"CPU": plan.per_node, "GPU": plan.per_node} if gpu else {"CPU": plan.per_node}
    _require_nodes(plan, bundle, address)
    strategy = "STRICT_SPREAD" if plan.nnodes > 1 else "STRICT_PACK"
    group = placement_group([bundle] * plan.nnodes, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise WorkerFailed(
            f"{plan.describe()}: the Ray cluster found no room for {plan.nnodes} × {bundle} "
            f"({strategy}) within {PLACEMENT_TIMEOUT_S} s; `ray status` shows what its nodes hold"
        ) from None
    return group


def _require_nodes(plan: PlacementPlan, bundle: dict[str, int], address: str | None) -> None:
    """A cluster without the nodes or devices asked for would leave the placement waiting: say so."""
    import ray

    kind = "GPU" if "GPU" in bundle else "CPU"
    device = "GPUs" if kind == "GPU" else "CPUs"
    nodes = [node for node in ray.nodes() if node["Alive"]]
    fit = [node for node in nodes if all(node["Resources"].get(k, 0) >= v for k, v in bundle.items())]
    cluster = f"the Ray cluster at RAY_ADDRESS={address}" if address else "the Ray cluster"
    hint = "; on a machine without GPUs use trainer.device=cpu" if kind == "GPU" else ""
    if len(fit) < plan.nnodes:
        raise WorkerFailed(
            f"{plan.describe()} needs {plan.nnodes} node(s) with {plan.per_node} {device} each; "
            f"{cluster} has {len(fit)} such of its {len(nodes)} nodes{hint}"
        )
    available = int(ray.available_resources().get(kind, 0))
    if available < plan.world_size:
        raise WorkerFailed(
            f"{plan.describe()} needs {plan.world_size} free {device} in {cluster}, "
            f"which has {available}{hint}"
        )


def where_am_i() -> tuple[int, str, str, str | None]:
    """(pid, node id, node address, Ray's log folder) of the calling Ray worker: a RankPlace."""
    import ray

    node = getattr(ray._private.worker.global_worker, "node", None)  # its log folder: no public API
    logs = node.get_logs_dir_path() if node is not None else None
    return os.getpid(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), logs


def dead_rank(pending: list, rank_of: dict, places: list[RankPlace], grace_s: float):
    """The first of the `pending` ranks (task refs → rank) found dead within `grace_s` seconds: Ray
    reports its process dead (RayActorError, returned), or its node no longer answers (None
    returned as its error: Ray reports that one later). Returns (rank, error), or None."""
    import ray
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + grace_s
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 0.5))
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as died:
                return rank_of[ref], died
            except Exception:  # another rank's own error is not the cause looked for
                continue
        lost = nodes_gone({places[rank_of[ref]].node_id for ref in pending if rank_of[ref] < len(places)})
        for ref in pending:
            if rank_of[ref] < len(places) and places[rank_of[ref]].node_id in lost:
                return rank_of[ref], None
    return None


def nodes_gone(node_ids: set[str]) -> set[str]:
    """Those of the nodes that are dead or whose raylet refuses connections or does not answer
    within 2 s (Ray itself marks a node dead some 15 s after it is gone)."""
    import ray

    alive = {node["NodeID"]: node for node in ray.nodes() if node["Alive"]} if node_ids else {}
    gone = set()
    for node_id in node_ids:
        node = alive.get(node_id)
        try:
            if node is None:
                raise OSError
            socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), 2).close()
        except OSError:
            gone.add(node_id)
    return gone
