"""Canopy's step against its own previous step on the same work (issue 48): per phase as a ratio, and start-up time
and memory against before.

    python bench/step_overhead.py [--baseline-rev 90ae7ce] [--steps 40] [--skip 5] [--rounds 2] [train.py overrides]

`python train.py` (the embedded default, without the evaluations outside the steps) runs at the baseline revision
(a temporary git worktree sharing this tree's `.cache`, so both train the same tiny checkpoint) and at this tree,
each in its own process, in lockstep: one step of one, then the same step of the other, never both at once, so that
the machine's drift falls on both alike and neither competes with the other for the CPU. Each process starts only
once the other is parked at its first step, so the start-ups are timed alone too. Same seed, same tasks, same
episodes: the step's work is the same in both as long as what is computed is.

Per step, each process times (wrapping the same functions in both trees): the step (Lightning's
`_TrainingEpochLoop.advance`), the rollout (`RolloutDataModule.next_batch`, of which generation is the run's own
`time/generation`), the reference forward (`CanopyModule._logprobs_no_grad`), the update
(`CanopyModule._optimizer_step`) and the weight sync (`EngineHandle.sync`); "other" is the step less all of them.
Start-up is the launch of the process to the start of its first step; RSS is read at that moment and, as the peak,
from the process's rusage when it exits. Printed: each phase's median per step, before and after, the ratio of
medians, and the median of the per-step ratios (the lockstep pairs); with `--rounds 2` the second round starts the
other tree first.
"""

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["generation", "rollout rest", "reference", "update", "weight sync", "other", "step"]
TIMED = {  # phase: (module, class, method) timed around each call, the same names in both trees
    "rollout": ("canopy.datamodules.rollout", "RolloutDataModule", "next_batch"),
    "reference": ("canopy.modules.canopy_module", "CanopyModule", "_logprobs_no_grad"),
    "update": ("canopy.modules.canopy_module", "CanopyModule", "_optimizer_step"),
    "weight sync": ("canopy.rollout.engine", "EngineHandle", "sync"),
}


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(launched: float, reply: int, wait: int, argv: list[str]) -> None:
    """In the process under test: train.py, each step parked until the parent says go, its phases timed."""
    import importlib

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    to_parent, from_parent = os.fdopen(reply, "w", buffering=1), os.fdopen(wait, "r")
    step_times: dict[str, float] = {}
    records: list[dict] = []

    def timed(phase, method):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            result = method(*args, **kwargs)
            step_times[phase] = step_times.get(phase, 0.0) + time.perf_counter() - started
            if phase == "rollout":
                step_times["generation"] = step_times.get("generation", 0.0) + result.metrics["time/generation"]
            return result

        return wrapper

    def patch(cls, name, wrap):
        setattr(cls, name, wrap(getattr(cls, name)))

    advance = _TrainingEpochLoop.advance

    def parked_advance(loop, *args, **kwargs):
        if not records:
            to_parent.write(json.dumps({"startup": time.time() - launched, "startup_rss_mb": rss_mb()}) + "\n")
        to_parent.write("ready\n")
        from_parent.readline()
        step_times.clear()
        started = time.perf_counter()
        advance(loop, *args, **kwargs)
        step = time.perf_counter() - started
        t = step_times
        records.append(
            {
                "step": step,
                "generation": t["generation"],
                "rollout rest": t["rollout"] - t["generation"],
                "reference": t.get("reference", 0.0),
                "update": t["update"],
                "weight sync": t["weight sync"],
                "other": step - t["rollout"] - t.get("reference", 0.0) - t["update"] - t["weight sync"],
            }
        )

    _TrainingEpochLoop.advance = parked_advance
    for phase, (module, cls, name) in TIMED.items():
        patch(getattr(importlib.import_module(module), cls), name, lambda method, phase=phase: timed(phase, method))
    sys.argv = argv
    try:
        runpy.run_path("train.py", run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    to_parent.write(json.dumps({"steps": records}) + "\n")


class Run:
    """One tree's train.py in its own process, driven step by step over two pipes."""

    def __init__(self, name: str, tree: Path, out: Path, steps: int, overrides: list[str]):
        self.name, self.tree = name, tree
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()
        argv = ["train.py", f"trainer.max_steps={steps}", f"hydra.run.dir={out}", *overrides]
        code = (
            f"import sys; sys.path[:0] = [{str(tree)!r}, {str(ROOT / 'bench')!r}]; import step_overhead; "
            f"step_overhead.child({time.time()!r}, {from_child_w}, {to_child_r}, {argv!r})"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)},
            pass_fds=(to_child_r, from_child_w),
            stdout=subprocess.DEVNULL,
            stderr=open(out.parent / f"{out.name}.log", "w"),
        )
        os.close(to_child_r), os.close(from_child_w)
        self.messages, self.result = os.fdopen(self.from_child, "r"), {}
        self.wait_ready()

    def wait_ready(self) -> bool:
        """Read up to the child's next 'ready' (True) or its end (False), keeping what it reports on the way."""
        for line in self.messages:
            if line == "ready\n":
                return True
            self.result.update(json.loads(line))
        _, status, usage = os.wait4(self.process.pid, 0)
        if status != 0:
            raise RuntimeError(f"{self.name}: train.py failed (exit status {status}); see its log beside the run")
        self.result["peak_rss_mb"] = usage.ru_maxrss / 1024  # KiB on Linux
        return False

    def step(self) -> bool:
        os.write(self.to_child, b"go\n")
        return self.wait_ready()


def lockstep(runs: list[Run]) -> None:
    going = list(runs)
    while going:
        going = [run for run in going if run.step()]


def summarize(results: dict[str, list[dict]], skip: int) -> list[str]:
    before_runs, after_runs = results["baseline"], results["this tree"]
    lines = ["| phase | before, s / step | after, s / step | before / after (medians) | median of step pairs |"]
    lines.append("|---|---|---|---|---|")
    for phase in PHASES:
        before = [s[phase] for r in before_runs for s in r["steps"][skip:]]
        after = [s[phase] for r in after_runs for s in r["steps"][skip:]]
        pairs = [
            b[phase] / a[phase]
            for rb, ra in zip(before_runs, after_runs)
            for b, a in zip(rb["steps"][skip:], ra["steps"][skip:])
            if a[phase] > 0
        ]
        b, a = statistics.median(before), statistics.median(after)
        paired = f"{statistics.median(pairs):.2f}x" if pairs else ""
        lines.append(f"| {phase} | {b:.4f} | {a:.4f} | {b / a if a else float('nan'):.2f}x | {paired} |")
    lines += ["", "| process | before | after | before / after |", "|---|---|---|---|"]
    for key, label in [
        ("startup", "launch to the first step, s"),
        ("startup_rss_mb", "RSS at the first step, MB"),
        ("peak_rss_mb", "peak RSS, MB"),
    ]:
        b, a = (statistics.median(r[key] for r in runs) for runs in (before_runs, after_runs))
        lines.append(f"| {label} | {b:.2f} | {a:.2f} | {b / a:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-rev", default="90ae7ce")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="first steps of each run left out (warm-up)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="keep the runs' folders and logs here")
    args, overrides = parser.parse_known_args()
    # no evaluation outside the steps: the base and final reports and the budget transfer sample with the engine too
    overrides = ["report.eval_samples_per_task=0", "callbacks.budget_transfer=null", *overrides]
    results: dict[str, list[dict]] = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory(prefix="canopy-bench-") as scratch:
        scratch = args.keep or Path(scratch)
        scratch.mkdir(parents=True, exist_ok=True)
        baseline = Path(tempfile.mkdtemp(prefix="canopy-baseline-"))
        baseline.rmdir()
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(baseline), args.baseline_rev], cwd=ROOT, check=True
        )
        try:
            (ROOT / ".cache").mkdir(exist_ok=True)
            (baseline / ".cache").symlink_to(ROOT / ".cache")
            trees = [("baseline", baseline), ("this tree", ROOT)]
            for round_ in range(args.rounds):
                order = trees if round_ % 2 == 0 else trees[::-1]
                runs = [
                    Run(name, tree, scratch / f"{name.replace(' ', '_')}-{round_}", args.steps, overrides)
                    for name, tree in order
                ]
                lockstep(runs)
                for run in runs:
                    results[run.name].append(run.result)
                    steps = run.result["steps"][args.skip :]
                    print(
                        f"round {round_} {run.name:<9}: start-up {run.result['startup']:.2f} s, step "
                        f"{statistics.median(s['step'] for s in steps):.3f} s (median), peak RSS "
                        f"{run.result['peak_rss_mb']:.0f} MB",
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=False)
    print(
        f"\nthis tree against {args.baseline_rev}: {args.rounds} round(s) of {args.steps} steps, the first {args.skip} "
        "of each run left out\n"
    )
    print("\n".join(summarize(results, args.skip)))


if __name__ == "__main__":
    main()
