"""Benchmark: what scaling out costs and saves, on this machine.

    python benchmarks/scale.py                      # all three parts
    python benchmarks/scale.py memory --model builtin:smollm2-135m-instruct
    python benchmarks/scale.py pipeline --steps 3
    python benchmarks/scale.py ray --calls 20

memory:   per-rank bytes of parameters + gradients + optimizer state of one model (SmolLM2-135M by
          default) after one optimizer step, at world size 1 (one process) and 2 (FSDP2, ZeRO-3),
          and each rank's peak RSS.
pipeline: the embedded default through the real flow at world size 1 and 2 (FSDP2), one torch thread
          per process: seconds per iteration and per update stage, and the scaling efficiency
          (one rank's update time / (2 × two ranks' time)).
ray:      Ray start-up with a worker group of two ranks, and the round trip of one call to every rank
          (a stage's dispatch overhead), median of --calls.

Not a test: numbers depend on the machine and on what else it is doing.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", choices=("memory", "pipeline", "ray", "all"), default="all")
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    print(f"machine: {platform.machine()} {_cpu()}, {os.cpu_count()} cores, torch {torch.__version__}\n")
    if args.part in ("memory", "all"):
        memory(args.model)
    if args.part in ("pipeline", "all"):
        pipeline(args.steps)
    if args.part in ("ray", "all"):
        ray_overhead(args.calls)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ---- memory ------------------------------------------------------------------------------------


def memory(model_path: str) -> None:
    directory = _model_dir(model_path)
    print(f"memory: {model_path} ({directory}), one AdamW step on 2 sequences of 32 tokens per rank")
    header = ("params MB", 11), ("grads MB", 10), ("optim MB", 10), ("total MB", 10), ("peak RSS MB", 13)
    print(f"  {'layout':<22}" + "".join(f"{name:>{width}}" for name, width in header))
    for name, world, strategy in (
        ("1 process", 1, None),
        ("FSDP2, 2 ranks", 2, "fsdp2"),
        ("ZeRO-3, 2 ranks", 2, "zero3"),
    ):
        spawn = mp.get_context("spawn")
        queue, ports = spawn.SimpleQueue(), spawn.SimpleQueue()
        context = mp.spawn(
            _memory_rank, args=(world, strategy, str(directory), ports, queue), nprocs=world, join=False
        )
        context.join()
        rows = [queue.get() for _ in range(world)]
        for rank, row in enumerate(sorted(rows)):
            _, params, grads, optim, rss = row
            label = f"{name} (rank {rank})" if world > 1 else name
            print(
                f"  {label:<22}{params / MB:>11.1f}{grads / MB:>10.1f}{optim / MB:>10.1f}"
                f"{(params + grads + optim) / MB:>10.1f}{rss / MB:>13.0f}"
            )
    print()


def _memory_rank(rank: int, world: int, strategy: str | None, directory: str, ports, queue) -> None:
    torch.set_num_threads(1)
    from ppoflow.engine.models import load_actor
    from ppoflow.engine.parallel import (
        DeepSpeedStepper,
        FSDP2Stepper,
        LocalStepper,
        deepspeed_engine,
        join_process_group,
        open_rendezvous,
        shard_fsdp2,
    )

    model = load_actor(directory)
    if world > 1:  # rank 0 listens at a port the kernel picks and tells the others
        if rank == 0:
            listener = open_rendezvous("127.0.0.1")
            port = listener.getsockname()[1]
            for _ in range(world - 1):
                ports.put(port)
        else:
            listener, port = None, ports.get()
        join_process_group(rank, world, "127.0.0.1", port, "cpu", listener)
    if strategy == "zero3":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        model = deepspeed_engine(
            model, optimizer, zero_stage=3, micro_batch_size=2, micro_batches=1, grad_clip=1.0
        )
        stepper = DeepSpeedStepper(model, optimizer)
    elif strategy == "fsdp2":
        model = shard_fsdp2(model, "cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        stepper = FSDP2Stepper(model, optimizer)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        stepper = LocalStepper(model, optimizer)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=ids, labels=ids).loss
    stepper.backward(loss, last=True)
    stepper.step(1.0)
    params, grads, optim = _resident_bytes(model, optimizer, strategy)
    if strategy == "fsdp2":  # a step frees the gradients; measure them with one more backward
        stepper.backward(model(input_ids=ids, labels=ids).loss, last=True)
        grads = sum(
            _local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
        )
    queue.put((rank, params, grads, optim, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _resident_bytes(model, optimizer, strategy) -> tuple[int, int, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state."""
    if strategy == "zero3":
        params = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.module.parameters())
        inner = model.optimizer
        grads = sum(t.numel() * t.element_size() for t in getattr(inner, "fp32_partitioned_groups_flat", []))
        optim = sum(
            v.numel() * v.element_size()
            for state in optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )
        return params, grads, optim
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    grads = sum(
        _local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
    )
    optim = sum(
        _local(v).numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )
    if grads == 0:  # freed by the step: as large as the parameters while they exist
        grads = params
    return params, grads, optim


def _model_dir(model_path: str) -> Path:
    from ppoflow.tasks.stages.prepare_model import converted_gguf, smollm2_gguf

    if model_path == "builtin:smollm2-135m-instruct":
        return converted_gguf(smollm2_gguf())
    return Path(model_path)


# ---- pipeline ----------------------------------------------------------------------------------


def pipeline(steps: int) -> None:

    print(f"pipeline: the embedded default, {steps} iterations, one torch thread per process")
    common = [
        f"trainer.total_training_steps={steps}",
        "trainer.num_threads=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    ]
    results = {}
    for world in (1, 2):
        with tempfile.TemporaryDirectory(prefix="ppoflow-scale-") as scratch:  # the run is removed after
            results[world] = _pipeline_run(common, world, Path(scratch) / "run")
    print(f"  {'':<12}{'update_actor s':>16}{'update_critic s':>17}{'step s':>9}{'run wall s':>12}")
    for world, r in results.items():
        print(f"  world {world:<6}{r['actor']:>16.3f}{r['critic']:>17.3f}{r['step']:>9.3f}{r['wall']:>12.1f}")
    one, two = results[1], results[2]
    for name in ("actor", "critic"):
        print(f"  scaling efficiency, {name} update: {one[name] / (2 * two[name]):.2f}")
    print()


def _pipeline_run(common: list[str], world: int, run_dir: Path) -> dict[str, float]:
    import duckdb

    from ppoflow.flows.train import ppo_train

    extra = (
        []
        if world == 1
        else [
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "critic.strategy=fsdp2",
        ]
    )
    started = time.perf_counter()
    ppo_train(None, [*common, f"trainer.default_local_dir={run_dir}", *extra])
    wall = time.perf_counter() - started
    rows = duckdb.sql(
        f'SELECT iter, "timing_s/update_actor", "timing_s/update_critic", "timing_s/step" '
        f"FROM read_parquet('{run_dir}/iter=*/metrics/*.parquet') ORDER BY iter"
    ).fetchall()
    later = rows[1:] or rows  # the first iteration also loads the models
    return {
        "actor": statistics.median(r[1] for r in later),
        "critic": statistics.median(r[2] for r in later),
        "step": statistics.median(r[3] for r in later),
        "wall": wall,
    }


# ---- ray ---------------------------------------------------------------------------------------


def ray_overhead(calls: int) -> None:
    from ppoflow.tasks.models.workers import WorkerGroup
    from ppoflow.tasks.pipeline.placement import PlacementPlan

    print(f"ray: a local instance and a worker group of 2 ranks (gloo), {calls} calls")
    started = time.perf_counter()
    group = WorkerGroup(PlacementPlan(world_size=2, device="cpu", num_threads=1))
    start_up = time.perf_counter() - started
    try:
        times = []
        for _ in range(calls):
            begun = time.perf_counter()
            group.call("pid", what="benchmark")
            times.append(time.perf_counter() - begun)
    finally:
        begun = time.perf_counter()
        group.close()
        shut_down = time.perf_counter() - begun
    print(f"  start-up (Ray, 2 workers, process group): {start_up:.2f} s")
    median, slowest = statistics.median(times) * 1e3, max(times) * 1e3
    print(f"  one call to every rank: median {median:.1f} ms, max {slowest:.1f} ms")
    print(f"  shut-down: {shut_down:.2f} s\n")


if __name__ == "__main__":
    sys.exit(main())
