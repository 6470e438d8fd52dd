"""Does the embedded default learn the same on CUDA as on the CPU? Runs the README's `ppoflow train`
twice with the same seed, once with trainer.device=cuda and once with trainer.device=cpu, and prints
both validation curves and how far apart the two final actors are.

    python benchmarks/device_agreement.py                      # seed 1, 40 steps
    python benchmarks/device_agreement.py --seed 2 -- trainer.total_training_steps=20
    python benchmarks/device_agreement.py --devices cpu cpu    # without a GPU: the same device twice

Responses sample from random streams on the CPU whatever the device, so the two runs see the same
tokens until a probability that rounds differently on the two devices lands on the other side of
a draw; their weights differ by rounding that training then carries along. Tolerance: every
validated step's greedy correctness within --correct-gap (0.03 = 3 of the 100 problems), and the
two final actors closer to each other than --weight-gap (0.05) of the distance the CPU run moved
from the initial weights, ‖θ_cuda − θ_cpu‖ ≤ 0.05 ‖θ_cpu − θ_0‖ (L2 over all weights). Exits 1
when either is exceeded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from ppoflow.tasks.stages.prepare_model import build_tiny_base

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also under PYTHONSAFEPATH (gpu_proof.sh)
from learning import run_seed  # noqa: E402


def weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no actor weights in {folder}")
    return {name: tensor.double() for file in files for name, tensor in load_file(file).items()}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[name] - b[name]).pow(2).sum()) for name in a) ** 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--devices", nargs=2, default=["cuda", "cpu"], metavar=("FIRST", "SECOND"))
    parser.add_argument("--correct-gap", type=float, default=0.03)
    parser.add_argument("--weight-gap", type=float, default=0.05)
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both runs (after --)")
    args = parser.parse_args()
    first, second = args.devices
    with tempfile.TemporaryDirectory(prefix="ppoflow-devices-") as scratch:
        runs, curves = {}, {}
        for index, device in enumerate((first, second)):
            runs[index] = Path(scratch) / f"{index}-{device}"
            overrides = [f"trainer.device={device}", *args.overrides]
            curves[index] = run_seed(args.seed, runs[index], overrides)
            points = " ".join(f"{step}:{correct:.2f}" for step, _, correct, _ in curves[index])
            print(f"{device:>5} seed {args.seed}: correct by step {points}  ({curves[index][-1][3]:.0f} s)")
        last = curves[0][-1][0]
        final = Path("checkpoints", f"iter={last:06d}", "actor")
        a, b = weights(runs[0] / final), weights(runs[1] / final)
    initial = weights(build_tiny_base(seed=args.seed))  # the warm start both runs began from
    gaps = [abs(x[2] - y[2]) for x, y in zip(curves[0], curves[1], strict=True)]
    moved, apart = distance(b, initial), distance(a, b)
    ratio = apart / moved
    print(
        f"largest correctness gap {max(gaps):.2f} (tolerance {args.correct_gap}); final actors "
        f"‖{first} − {second}‖ = {apart:.3g}, {ratio:.4f} of ‖{second} − initial‖ = {moved:.3g} "
        f"(tolerance {args.weight_gap})"
    )
    agree = max(gaps) <= args.correct_gap and ratio <= args.weight_gap
    print(f"device agreement: {'within' if agree else 'OUTSIDE'} tolerance")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
