"""What the trajectory logs and the rollout viewer cost a training step, against a run without them.

Runs `train.py` (the embedded default, or any overrides after `--`) with and without the logs and the viewer, in
the order A B B A repeated (so a drift of the machine falls on both alike), and compares the mean wall time of a
step from TensorBoard's event times, past the first `--skip` steps (start-up). The runs sample the same episodes
(same seed; logging draws no randomness), so the difference is the logging alone. Prints the ratio.

    python bench/logging_overhead.py [--steps 40 --skip 10 --repeats 1] [-- overrides]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "without logs": ["trajectories.enabled=false", "callbacks.rollout_viewer=null"],
    "with logs": ["callbacks.rollout_viewer.every_n_steps=5"],  # the viewer rebuilt 4x as often as by default
}


def step_seconds(run_dir: Path, skip: int) -> float:
    """Mean seconds between consecutive training steps, from the wall times of the `actor/loss` events."""
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload().Scalars("actor/loss")
    times = [e.wall_time for e in events if e.step >= skip]
    return (times[-1] - times[0]) / (len(times) - 1)


def run(name: str, out: Path, args, number: int) -> float:
    run_dir = out / f"{name.replace(' ', '_')}_{number}"
    command = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={args.steps}",
        "report.eval_samples_per_task=0",
        "eval.every_n_steps=0",
        *VARIANTS[name],
        *args.overrides,
    ]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    seconds = step_seconds(run_dir, args.skip)
    logs = run_dir / "trajectories"
    size = sum(p.stat().st_size for p in logs.rglob("*") if p.is_file()) if logs.is_dir() else 0
    print(f"{name}: {seconds:.3f} s per step, trajectory logs {size / 2**20:.2f} MB", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the mean (start-up)")
    parser.add_argument("--repeats", type=int, default=1, help="how many A B B A rounds")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as out:
        for number in range(args.repeats):
            for name in ("without logs", "with logs", "with logs", "without logs"):
                times[name].append(run(name, Path(out), args, number * 4 + len(times[name])))
    base, logged = statistics.mean(times["without logs"]), statistics.mean(times["with logs"])
    spread = max(statistics.pstdev(t) / statistics.mean(t) for t in times.values())
    print(
        f"\nstep time with trajectory logs and viewer / without: {logged / base:.3f} "
        f"({logged:.3f} s vs {base:.3f} s per step; runs of one variant differ by {100 * spread:.1f}% (std))"
    )


if __name__ == "__main__":
    main()
