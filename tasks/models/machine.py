"""What a run needs of this machine, checked before anything runs: a CUDA device for
trainer.device=cuda, and vLLM (with that device) for actor_rollout_ref.rollout.name=vllm."""

from __future__ import annotations

import importlib.util
import sys

import torch

GPU_SETUP = "bash scripts/setup --gpu"
"""The command that installs the GPU environment (vLLM and the CUDA build of torch it pins)."""


def machine_problem(device: str, rollout_engine: str) -> str | None:
    """One line saying what this machine lacks for a run on `device` generating with
    `rollout_engine`, and what to do; None when it has everything."""
    missing = []
    if device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        missing.append(f"torch {torch.__version__} ({build}) sees no CUDA device")
    if rollout_engine == "vllm" and importlib.util.find_spec("vllm") is None:
        missing.append(f"vllm is not installed in this Python ({sys.executable})")
    if not missing:
        return None
    if rollout_engine == "vllm":
        wanted, needs = "actor_rollout_ref.rollout.name=vllm with trainer.device=cuda", "a CUDA GPU and vLLM"
        instead = "actor_rollout_ref.rollout.name=hf trainer.device=cpu"
    else:
        wanted, needs, instead = "trainer.device=cuda", "a CUDA GPU", "trainer.device=cpu"
    return (
        f"{wanted} needs {needs}, but {' and '.join(missing)}: on a GPU machine, set up with "
        f"`{GPU_SETUP}`; here, train with {instead}"
    )


class MachineUnsuitable(RuntimeError):
    """The run needs what this machine does not have (a CUDA device, vLLM)."""


def require_machine(device: str, rollout_engine: str) -> None:
    """MachineUnsuitable with `machine_problem`'s line, if there is one."""
    problem = machine_problem(device, rollout_engine)
    if problem is not None:
        raise MachineUnsuitable(problem)
