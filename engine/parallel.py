"""Data-parallel, sharded training over a torch.distributed process group: FSDP2 (torch's
`fully_shard`) or DeepSpeed ZeRO stage 1–3. One process per device (on CPU: one per worker, gloo).

Every rank runs the same update loop (engine/update.py) on its contiguous share of each mini-batch;
the loss of a share is normalised by the denominator of the whole mini-batch, so the gradients the
strategy reduces add up to the one-process gradient. Both strategies average gradients over the
ranks, so each rank's loss is scaled by the world size (FSDP2's sum reduction would need
PREMUL_SUM, which gloo does not have). The lr schedule stays the client optimizer's own.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from .names import Strategy

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for the others in one collective before it fails (a dead peer is noticed
by the worker group sooner: tasks/models/workers.py)."""


def open_rendezvous(host: str) -> socket.socket:
    """Rank 0's listening socket for the process group's store, on `host` at a port the kernel picks:
    the port is this group's from the start. (A port found free and bound later by the store can be
    taken meanwhile by another run on the machine, and the store's own socket listens on every
    interface.)"""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener


def join_process_group(
    rank: int,
    world: int,
    master_addr: str,
    master_port: int,
    device: str,
    listener: socket.socket | None = None,
) -> None:
    """Join the run's process group as `rank` of `world` (gloo on CPU, NCCL on CUDA) through a store
    at master_addr:master_port; rank 0 serves it on `listener` (`open_rendezvous`). DeepSpeed also
    reads the rendezvous from the environment, so it is set there too."""
    if (rank == 0) != (listener is not None):
        raise ValueError(f"rank {rank}: rank 0, and it alone, serves the store on its listening socket")
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0" if device == "cpu" else str(rank % max(1, torch.cuda.device_count())),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    store = dist.TCPStore(
        master_addr,
        master_port,
        world,
        is_master=rank == 0,
        timeout=COLLECTIVE_TIMEOUT,
        master_listen_fd=None if listener is None else listener.detach(),  # the store closes it
    )
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )


def all_sum(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over the ranks (one collective for the whole dict)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not values:
        return dict(values)
    names = sorted(values)
    tensor = torch.tensor([float(values[n]) for n in names], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor)
    return dict(zip(names, tensor.tolist(), strict=True))


def _collective_device() -> str:
    """Where a collective's tensor must be: on the GPU for NCCL, on the CPU for gloo."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def all_max(count: int) -> int:
    """The largest of every rank's `count` (a collective: every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count
    tensor = torch.tensor([count], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks a causal LM or token classifier is sharded by (verl wraps each module
    class the model names in `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


class LocalStepper:
    """One process: gradients accumulate in place, one clipped optimizer step per mini-batch."""

    rank, world = 0, 1

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        loss.backward()

    def step(self, grad_clip: float) -> float:
        """Clip gradients to `grad_clip`, step unless the norm is not finite; the pre-clip norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def reduce(self, values: dict[str, float]) -> dict[str, float]:
        return dict(values)

    def agree(self, count: int) -> int:
        """The largest of every rank's `count` (one process: `count`)."""
        return count


class _GroupStepper(LocalStepper):
    """A rank of the process group: metrics are summed and micro-batch counts agreed over the ranks."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(model, optimizer)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def reduce(self, values: dict[str, float]) -> dict[str, float]:
        return all_sum(values)

    def agree(self, count: int) -> int:
        return all_max(count)


class FSDP2Stepper(_GroupStepper):
    """FSDP2: parameters, gradients and optimizer state sharded over the ranks; a mini-batch's
    gradients are reduce-scattered once, after its last micro-batch."""

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self.model.set_requires_gradient_sync(last)
        (loss * self.world).backward()

    def step(self, grad_clip: float) -> float:
        """Clip and step as one process would: the norm is taken over each parameter's whole
        gradient (gathered one parameter at a time), so the clip factor, and with it every weight,
        matches the one-process result instead of differing in the last bits (which AdamW
        amplifies in gradients near zero)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norms = [torch.linalg.vector_norm(g.full_tensor(), 2) for g in grads]
        grad_norm = torch.linalg.vector_norm(torch.stack(norms), 2) if norms else torch.tensor(0.0)
        coefficient = torch.clamp(grad_clip / (grad_norm + 1e-6), max=1.0)
        if torch.isfinite(grad_norm):
            for g in grads:
                g.mul_(coefficient)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)


class DeepSpeedStepper(_GroupStepper):
    """DeepSpeed ZeRO: the engine accumulates micro-batches and steps (clipping included) at the
    end of each mini-batch; `model` is the DeepSpeed engine."""

    def __init__(self, engine, optimizer: torch.optim.Optimizer):
        super().__init__(engine, optimizer)
        self._norm = 0.0

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self.model.set_gradient_accumulation_boundary(last)
        self.model.backward(loss * self.world, scale_wrt_gas=False)
        self.model.step()  # a no-op except at the boundary, where it clips, steps and zeroes
        if last:
            self._norm = float(self.model.get_global_grad_norm() or 0.0)

    def step(self, grad_clip: float) -> float:
        return self._norm


def shard_fsdp2(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """Shard `model` in place over the whole process group: each decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def deepspeed_engine(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    zero_stage: int,
    micro_batch_size: int,
    micro_batches: int,
    grad_clip: float,
    offload_optimizer: bool = False,
):
    """`model` and its (client, torch) optimizer under DeepSpeed ZeRO `zero_stage`, accumulating
    `micro_batches` micro-batches of `micro_batch_size` per optimizer step on each rank. Without an
    optimizer (a model only generated from or valued), ZeRO-3 still partitions its parameters."""
    import deepspeed

    _skip_shared_memory_build()
    zero: dict = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # offload with the client's torch AdamW
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _skip_shared_memory_build() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory C++ op on its first initialize (tens of
    seconds, with a compiler) to speed up intra-node collectives; gloo does without it."""
    comm = sys.modules.get("deepspeed.comm.torch")
    if comm is not None and hasattr(comm, "build_shm_op"):
        comm.build_shm_op = lambda: None


def full_state_dict(
    model: torch.nn.Module, strategy: Strategy, zero_stage: int = 0
) -> dict[str, torch.Tensor]:
    """The whole model's weights, on every rank (a collective: every rank calls it)."""
    if strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    module = model.module
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
