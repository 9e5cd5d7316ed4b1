"""Where a training step's time goes (issue 48): `python train.py` (the embedded default) in this process, its main
thread's stack sampled every few milliseconds, each step's samples split into phases and what is left of the
rollout and of the step attributed to the code that was running.

    python bench/step_profile.py [--steps 40] [--top 12] [--interval-ms 2] [--out FILE] [train.py overrides ...]
    python bench/step_profile.py --ops [--steps 20] [--skip 5] ...

`--ops` names where the trainer's compute phases go instead: no sampler; each call of the reference forward and of
the update past the first `--skip` steps runs under `torch.profiler`, and each phase's time is split into the torch
operators' own CPU time (`self_cpu_time_total`, summed by operator over the calls) and the Python around them.
Generation is left to the sampler: its thousands of small operators per step make the profiler's own cost per
operator most of what it would measure (1.36 s per step under it against 0.18 s without, here).

A sample is the step's when Lightning's `_TrainingEpochLoop.advance` is on the stack. Its phase is the first of
these on the stack: generation (`LocalEngine.generate`), the rest of the rollout (`RolloutDataModule.next_batch`:
the environment, the agent loop, scoring, packing), the reference forward (`_logprobs_no_grad`), the update
(`_optimizer_step`), the weight sync (`EngineHandle.sync`); else "other" (Lightning's loop, hooks, callbacks,
logging). Generation is then attributed to the deepest frame on the stack that is Canopy's, Transformers' or
torch's (file and function: the model's modules, the cache, the sampling loop), the rollout's rest and the other
time to the deepest that is Canopy's or Lightning's. A sample stands for the time since the one before (the
sampler waits for the GIL while Python code holds it); the sampler thread costs the run some time (it competes for
the GIL and the CPU), so the phases measured by the run itself (`time/*` in TensorBoard) are printed beside them.
"""

import argparse
import importlib
import runpy
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canopy.reports.tb_scalars import read_scalars  # noqa: E402

STEP = ("loops/training_epoch_loop.py", "advance")
PHASES = [  # (phase, (file suffix, function)), the innermost first: a sample's phase is the first found on its stack
    ("generation", ("rollout/local.py", "generate")),
    ("rollout rest", ("datamodules/rollout.py", "next_batch")),
    ("reference", ("modules/canopy_module.py", "_logprobs_no_grad")),
    ("update", ("modules/canopy_module.py", "_optimizer_step")),
    ("weight sync", ("rollout/engine.py", "sync")),
]
LOGGED = {
    "generation": "time/generation",
    "rollout rest": "time/env",
    "reference": "time/reference",
    "update": "time/update",
    "weight sync": "time/weight_sync",
}
NAMED = {  # phase: whose frames its attribution names (the innermost of them)
    "generation": ("/canopy/", "/transformers/", "/torch/"),
    "rollout rest": ("/canopy/", "/lightning/"),
    "other": ("/canopy/", "/lightning/"),
}


class StackSampler(threading.Thread):
    """Samples the main thread's stack, as (file, function) pairs from the outermost frame, every `interval` s."""

    def __init__(self, interval: float):
        super().__init__(daemon=True)
        self.interval, self.samples, self.done = interval, [], threading.Event()
        self.main = threading.main_thread().ident

    def run(self) -> None:
        last = began = time.perf_counter()
        while not self.done.is_set():
            frame, stack = sys._current_frames().get(self.main), []
            now = time.perf_counter()
            while frame is not None:
                stack.append((frame.f_code.co_filename, frame.f_code.co_name))
                frame = frame.f_back
            self.samples.append((stack[::-1], now - last))  # the time since the last sample: see `report`
            last = now
            time.sleep(self.interval)
        self.period = (time.perf_counter() - began) / max(1, len(self.samples))


def on_stack(stack, where) -> bool:
    suffix, name = where
    return any(path.endswith(suffix) and function == name for path, function in stack)


def deepest_own(stack, packages: tuple[str, ...]) -> str:
    """The innermost frame of these packages' code: `path:function`, the path from the package on (its last
    occurrence: a virtual environment inside a folder named like a package holds other packages)."""
    for path, function in reversed(stack):
        at, package = max((path.rfind(package), package) for package in packages)
        if at >= 0:
            return f"{path[at + 1 :]}:{function}"
    return "(elsewhere)"


def train_here(steps: int, overrides: list[str], run_dir: Path) -> None:
    """train.py, `steps` steps, in this process."""
    argv = sys.argv
    sys.argv = ["train.py", f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}", *overrides]
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    finally:
        sys.argv = argv


def run_train(steps: int, overrides: list[str], run_dir: Path, interval: float) -> StackSampler:
    """train.py in this process, sampled; the sampler, stopped."""
    sampler = StackSampler(interval)
    sampler.start()
    try:
        train_here(steps, overrides, run_dir)
    finally:
        sampler.done.set()
        sampler.join()
    return sampler


OPS_PHASES = {  # phase: (module, class, method), each call profiled on its own
    "reference": ("canopy.modules.canopy_module", "CanopyModule", "_logprobs_no_grad"),
    "update": ("canopy.modules.canopy_module", "CanopyModule", "_optimizer_step"),
}


class OpProfile:
    """Per phase: wall seconds and each torch operator's own CPU seconds, over the profiled calls."""

    def __init__(self, skip: int):
        self.skip, self.calls = skip, Counter()
        self.wall, self.ops = Counter(), {phase: Counter() for phase in OPS_PHASES}

    def wrap(self, phase: str, method):
        import torch.profiler

        def profiled(*args, **kwargs):
            self.calls[phase] += 1
            if self.calls["update"] < self.skip:  # warm-up steps: the update runs once per step
                return method(*args, **kwargs)
            began = time.perf_counter()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                result = method(*args, **kwargs)
            self.wall[phase] += time.perf_counter() - began
            for event in profile.key_averages():
                self.ops[phase][event.key] += event.self_cpu_time_total / 1e6
            return result

        return profiled

    def install(self) -> None:
        for phase, (module, cls, name) in OPS_PHASES.items():
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, name, self.wrap(phase, getattr(owner, name)))

    def report(self, steps: int, top: int, command: str) -> str:
        profiled = steps - self.skip
        lines = [f"`{command}`: the last {profiled} of {steps} steps profiled.", ""]
        for phase in OPS_PHASES:
            wall, ops = self.wall[phase] / profiled, self.ops[phase]
            in_ops = sum(ops.values()) / profiled
            lines += [
                f"{phase}: {wall:.3f} s per step under the profiler, {in_ops:.3f} s in torch operators, "
                f"{wall - in_ops:.3f} s around them",
                "",
                "| operator | s / step | share of the phase |",
                "|---|---|---|",
            ]
            lines += [f"| `{op}` | {t / profiled:.4f} | {t / profiled / wall:.0%} |" for op, t in ops.most_common(top)]
            lines.append("")
        return "\n".join(lines)


def run_ops(steps: int, skip: int, overrides: list[str], run_dir: Path) -> OpProfile:
    """train.py in this process, its compute phases under the torch profiler past the first `skip` steps."""
    ops = OpProfile(skip)
    ops.install()
    train_here(steps, overrides, run_dir)
    return ops


def split(samples: list, steps: int) -> tuple[Counter, dict[str, Counter]]:
    """Seconds per step by phase, and generation, the rollout's rest and the other time by the innermost frame of
    the code `NAMED` names for them, from (stack, seconds) samples. Each sample stands for the time since the one
    before: the sampler waits for the GIL while Python code holds it and gets it at once while a torch kernel runs, so
    counting samples alone would under-weight Python code."""
    seconds: Counter = Counter()
    where: dict[str, Counter] = {phase: Counter() for phase in NAMED}
    for stack, weight in samples:
        if not on_stack(stack, STEP):
            continue
        phase = next((phase for phase, at in PHASES if on_stack(stack, at)), "other")
        seconds[phase] += weight / steps
        if phase in where:
            where[phase][deepest_own(stack, NAMED[phase])] += weight / steps
    return seconds, where


def report(sampler: StackSampler, run_dir: Path, steps: int, top: int, command: str) -> str:
    seconds, where = split(sampler.samples, steps)
    in_step = [sample for sample in sampler.samples if on_stack(sample[0], STEP)]
    logged = read_scalars(run_dir / "tensorboard")
    means = {phase: statistics.mean(v for _, v in logged[tag]) for phase, tag in LOGGED.items() if tag in logged}
    lines = [
        f"`{command}`: {steps} steps, {len(in_step):,} samples in the steps (one every {sampler.period * 1e3:.1f} ms).",
        "",
        "| phase | s / step (sampled) | s / step (the run's own `time/*`) |",
        "|---|---|---|",
    ]
    for phase in [phase for phase, _ in PHASES] + ["other"]:
        logged_value = f"{means[phase]:.3f}" if phase in means else ""
        lines.append(f"| {phase} | {seconds[phase]:.3f} | {logged_value} |")
    lines.append(f"| step | {sum(seconds.values()):.3f} | |")
    for phase, by_code in where.items():
        lines += [
            "",
            f"{phase}, by the innermost frame of {', '.join(p.strip('/') for p in NAMED[phase])}:",
            "",
            "| code | s / step |",
            "|---|---|",
        ]
        lines += [f"| `{code}` | {s:.4f} |" for code, s in by_code.most_common(top)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=12, help="code locations listed per attribution")
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--out", type=Path, help="also write the report (markdown) here")
    parser.add_argument("--ops", action="store_true", help="the compute phases by torch operator (no sampler)")
    parser.add_argument("--skip", type=int, default=5, help="with --ops: steps left unprofiled first")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after the two below)")
    args = parser.parse_args()
    # no evaluation outside the steps: the base and final reports and the budget transfer sample with the engine too
    overrides = ["report.eval_samples_per_task=0", "callbacks.budget_transfer=null", *args.overrides]
    how = (
        f"--ops --steps {args.steps} --skip {args.skip}"
        if args.ops
        else (f"--steps {args.steps} --interval-ms {args.interval_ms:g}")
    )
    command = " ".join(["python bench/step_profile.py", how, *args.overrides])
    with tempfile.TemporaryDirectory(prefix="step_profile_") as folder:
        run_dir = Path(folder) / "run"
        if args.ops:
            text = run_ops(args.steps, args.skip, overrides, run_dir).report(args.steps, args.top, command)
        else:
            sampler = run_train(args.steps, overrides, run_dir, args.interval_ms / 1e3)
            text = report(sampler, run_dir, args.steps, args.top, command)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
