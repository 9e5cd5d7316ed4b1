"""What the trajectory logs and the rollout viewer cost a training step, against a run without them.

Runs `train.py` (the embedded default, or any overrides after `--`) with and without the logs and the viewer, in
the order A B B A repeated (so a drift of the machine falls on both alike), and compares the mean wall time of a
step from TensorBoard's event times, past the first `--skip` steps (start-up). The runs sample the same episodes
(same seed; logging draws no randomness), so the difference is the logging alone. Prints the ratio.

Where the machine itself drifts by more than the logging costs (a shared 2-core VM), the ratio cannot resolve it;
the logging's own work is then counted directly, free of drift: the writer thread's CPU time per step (kept in each
index line) and the CPU time of one viewer build over the run's logs, spread over its 20 steps, as a share of the
step's wall time.

    python bench/logging_overhead.py [--steps 60 --skip 10 --repeats 3] [-- overrides]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canopy.tools.viewer import build_viewer  # noqa: E402
from canopy.trajectories import read_index  # noqa: E402

VARIANTS = {
    "without logs": ["trajectories.enabled=false", "callbacks.rollout_viewer=null"],
    "with logs": [],  # the defaults: every episode of every step logged, the viewer rebuilt every 20 steps
}


def step_seconds(run_dir: Path, skip: int) -> float:
    """Mean seconds between consecutive training steps, from the wall times of the `actor/loss` events."""
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload().Scalars("actor/loss")
    times = [e.wall_time for e in events if e.step >= skip]
    return (times[-1] - times[0]) / (len(times) - 1)


def logging_work(run_dir: Path, every_n_steps: int = 20) -> tuple[float, float]:
    """(writer CPU ms per step, viewer CPU ms per step): the index's `write_cpu_ms`, and one viewer build timed here
    over the run's logs (as the callback builds it, every `every_n_steps` steps)."""
    index = read_index(run_dir / "trajectories" / "train")
    writer = statistics.mean(line["write_cpu_ms"] for line in index)
    started = time.thread_time()
    build_viewer(run_dir)
    return writer, 1000 * (time.thread_time() - started) / every_n_steps


def run(name: str, out: Path, args, number: int, work: list) -> float:
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
    line = f"{name}: {seconds:.3f} s per step, trajectory logs {size / 2**20:.2f} MB"
    if size:
        writer, viewer = logging_work(run_dir)
        work.append((writer + viewer) / (1000 * seconds))
        line += f"; logging work per step: writer {writer:.1f} ms + viewer {viewer:.1f} ms CPU"
    print(line, flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps per run (the viewer is rebuilt every 20)")
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the mean (start-up)")
    parser.add_argument("--repeats", type=int, default=3, help="how many A B B A rounds")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    work: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        for number in range(args.repeats):
            for name in ("without logs", "with logs", "with logs", "without logs"):
                times[name].append(run(name, Path(out), args, number * 4 + len(times[name]), work))
    base, logged = statistics.mean(times["without logs"]), statistics.mean(times["with logs"])
    spread = max(statistics.pstdev(t) / statistics.mean(t) for t in times.values())
    print(
        f"\nstep time with trajectory logs and viewer / without: {logged / base:.3f} "
        f"({logged:.3f} s vs {base:.3f} s per step; runs of one variant differ by {100 * spread:.1f}% (std))\n"
        f"the logging's own CPU work per step / step time: {100 * statistics.mean(work):.2f}% "
        f"(writer thread and viewer builds, counted directly)"
    )


if __name__ == "__main__":
    main()
