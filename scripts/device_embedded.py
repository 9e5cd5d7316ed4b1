"""Device checks (d) and (e): the embedded default (`python train.py`, its tiny model and built-in environment) on
the GPU, each a real `train.py` run read back from its TensorBoard scalars and summary.json.

(d) `--part gap`: the local engine in bf16 on the GPU against the float32 trainer: the engine-trainer gap
    (`mismatch/logprob_gap`, mean |log pi_theta - log mu| per action token; `mismatch/kl`) on the sampled episodes
    of each step, the number `engine.gap_bounds.bfloat16` is calibrated from. The audit's bounds are opened wide
    for this run so that it measures rather than stops, and its closing evaluations are skipped.
(e) `--part learn`: 20 steps with trainer and engine on the GPU: step time against 3 steps of the same run on
    the CPU (`time/*` summed per step, medians), and that it learns (success of the base and final policies on
    the training tasks, summary.json; reward/success of the first and last steps).

    python scripts/device_embedded.py --part gap|learn               # on the GPU machine
    python scripts/device_embedded.py --part gap|learn --cpu-dry-run  # the same runs, smaller, on the CPU
The last line is `RESULT {json}`.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canopy.tools.tb_scalars import read_scalars  # noqa: E402

STEP_TIMES = ("time/env", "time/generation", "time/reference", "time/update", "time/weight_sync")
WIDE_BOUNDS = "{parity: 10, warn: 10, stop: 10}"
# the CPU dry run's runs: fewer episodes per step and per evaluation, from a tiny model warmed in 30 steps, not 200
DRY_RUN = [
    "data.tasks_per_step=2",
    "algorithm.group_size=4",
    "report.eval_samples_per_task=1",
    "model.tiny.format_warmup_steps=30",
]


def train(run_dir: Path, steps: int, gpu: bool, overrides: list[str]) -> tuple[dict, dict, float]:
    """`train.py` for `steps` steps; returns its scalars, its summary.json and its wall time."""
    device = ["trainer.accelerator=gpu", "engine.local.device=cuda"] if gpu else []
    command = [sys.executable, "train.py", f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}", *device]
    started = time.perf_counter()
    print("$ " + " ".join(command + overrides), flush=True)
    done = subprocess.run(command + overrides, cwd=ROOT)  # its output goes to this part's log as it runs
    seconds = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"device_embedded: {' '.join(command + overrides)} failed (exit {done.returncode})")
    summary_file = run_dir / "summary.json"  # written when the run evaluates its base and final policies
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return read_scalars(run_dir / "tensorboard"), summary, seconds


def step_seconds(scalars: dict, skip_first: bool) -> float:
    """Median seconds per step (its timed phases summed); the first step, which compiles and warms up, skipped."""
    per_step: dict[int, float] = {}
    for name in STEP_TIMES:
        for step, value in scalars.get(name, []):
            per_step[step] = per_step.get(step, 0.0) + value
    steps = sorted(per_step)[1:] if skip_first and len(per_step) > 1 else sorted(per_step)
    return statistics.median(per_step[step] for step in steps)


def values(scalars: dict, name: str) -> list[float]:
    return [value for _, value in sorted(scalars.get(name, []))]


def gap(work: Path, gpu: bool, steps: int, extra: list[str]) -> dict:
    # the gap is logged by every step; the run's closing evaluations are not needed
    overrides = ["engine.local.dtype=bfloat16", f"engine.gap_bounds.bfloat16={WIDE_BOUNDS}", *extra]
    overrides += ["report.eval_samples_per_task=0", "callbacks.budget_transfer=null"]
    scalars, _, _ = train(work / "gap", steps, gpu, overrides)
    gaps, kls = values(scalars, "mismatch/logprob_gap"), values(scalars, "mismatch/kl")
    print(f"bf16 engine against the float32 trainer, per step: logprob gap {[f'{g:.2e}' for g in gaps]}")
    print(f"  mismatch/kl {[f'{k:.2e}' for k in kls]}; largest gap {max(gaps):.3e}")
    return dict(logprob_gap=gaps, kl=kls, largest_gap=max(gaps), engine="local, bfloat16", trainer="float32")


def learn(work: Path, gpu: bool, steps: int, cpu_steps: int, extra: list[str]) -> dict:
    scalars, summary, wall = train(work / "learn", steps, gpu, extra)
    cpu_scalars, _, cpu_wall = train(work / "cpu", cpu_steps, False, extra)
    device_step, cpu_step = step_seconds(scalars, True), step_seconds(cpu_scalars, True)
    success = values(scalars, "reward/success")
    k = max(1, len(success) // 4)
    first, last = statistics.mean(success[:k]), statistics.mean(success[-k:])
    print(f"{steps} steps {'on the GPU' if gpu else 'on the CPU (dry run)'}: {device_step:.2f} s per step")
    print(f"{cpu_steps} steps on the CPU: {cpu_step:.2f} s per step; ratio {cpu_step / device_step:.2f}x")
    print(f"reward/success: first {k} steps {first:.3f}, last {k} {last:.3f}; summary: {json.dumps(summary)[:400]}")
    return dict(
        steps=steps,
        step_s=device_step,
        cpu_step_s=cpu_step,
        cpu_over_device=cpu_step / device_step,
        wall_s=wall,
        cpu_wall_s=cpu_wall,
        success_first=first,
        success_last=last,
        learns=last > first,
        summary=summary,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["gap", "learn"], required=True)
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    gpu = not args.cpu_dry_run
    extra = [] if gpu else DRY_RUN
    with tempfile.TemporaryDirectory() as work:
        if args.part == "gap":
            result = gap(Path(work), gpu, steps=5 if gpu else 2, extra=extra)
        else:
            result = learn(Path(work), gpu, steps=20 if gpu else 3, cpu_steps=3, extra=extra)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
