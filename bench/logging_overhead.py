"""What the trajectory logs and the rollout viewer cost a training step.

In one process (always): a real rollout step of the embedded default (or of the overrides after `--`), generation
with the in-process engine, then a forward and backward pass over its batch, is timed with and without the logging
beside it. Each round replays the same step (same tasks, same seed, so the same episodes) once per variant, in a
rotating order, so the machine's drift (on a shared 2-core VM, up to +-30% over tens of seconds) falls on every
variant alike (the first round, while the writers' processes start, is not counted):

  none                  nothing beside the step
  one step, <design>    the step's episodes handed to the trajectory log at the step's end, as in training
  busy, <design>        a writer writing logs and rebuilding the viewer without pause through the step: the worst case

each for the writer as it was (`thread`: a thread of the training process at its priority) and as it is (`process`:
a process of its own at idle priority, the same `Writer` code). Printed: each variant's step time over `none`'s in
the same round (geometric mean over rounds, 95% interval), how many steps' logs the busy writer wrote per step, what
handing a step over costs the training process itself (its episodes as builtins, pickled), and the peak memory (RSS)
of the trajectory writer process and of a rollout viewer build (`python -m canopy.tools.viewer`, as the callback
runs it) beside the training process's own.

End to end (`--end-to-end`): two `train.py` runs of the same seed switch the logs and the viewer on and off every
`--block` steps, in opposite phase, so that each step is timed against the same step of the other run, which ran the
other way; a run-wide difference in the machine's speed cancels between the blocks where the first run logs and
those where the second does. Per block, the mean log ratio of a step with logs to without (the first step of each
block left out: the previous block's writer may still run); per pair of runs, the mean of the two phases' means.
While on, the viewer is rebuilt at the start of each block (at the default 10, twice as often as the default 20).
Also counted: the logging's own CPU work (the writer's `write_cpu_ms` per step, one viewer build spread over a
block). This needs a machine steadier than its effect: identical steps of two runs differ by up to 30% on a shared
VM.

    python bench/logging_overhead.py [--rounds 40] [--end-to-end --steps 70 --skip 10 --block 10 --repeats 2
                                      --keep DIR] [-- overrides]
"""

import argparse
import dataclasses
import math
import multiprocessing
import pickle
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import lightning as L
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canopy import trajectories  # noqa: E402
from canopy.build import build_datamodule, ensure_model  # noqa: E402
from canopy.callbacks import RolloutViewer  # noqa: E402
from canopy.config import compose_config  # noqa: E402
from canopy.modules.logprobs import model_token_logprobs, sequence_inputs  # noqa: E402
from canopy.modules.policy import load_policy  # noqa: E402
from canopy.reports.viewer import build_viewer  # noqa: E402
from canopy.trajectories import INDEX, Sampling, TrajectoryLog, read_index, sampling_of  # noqa: E402

DESIGNS = ("thread", "process")  # the writer as it was (a thread of the training process), and as it is


def step_episodes(groups, advantages, reward_kind: str) -> list[dict]:
    """A step's episodes as the trajectory log hands them to its writer (`plain_episodes`)."""
    return trajectories.plain_episodes(groups, range(len(groups)), advantages, reward_kind)


class Capture:
    """Stands in for the trajectory log to keep one step's groups."""

    def log_step(self, stream, step, groups, advantages=None):
        self.groups, self.advantages = groups, advantages


class ThreadLog:
    """The trajectory log as it was: the same `Writer`, on a thread of the training process at its priority."""

    def __init__(self, writer: trajectories.Writer, reward_kind: str):
        self.writer, self.reward_kind, self.steps = writer, reward_kind, queue.Queue()
        threading.Thread(target=self.work, daemon=True).start()

    def work(self) -> None:
        while True:
            self.writer._write(*self.steps.get())
            self.steps.task_done()

    def log_step(self, stream, step, groups, advantages=None):
        self.steps.put((stream, step, step_episodes(groups, advantages, self.reward_kind)))

    def wait(self) -> None:
        self.steps.join()


def peak_rss_mb(pid: int) -> float:
    """A live process's peak resident memory so far (Linux's VmHWM), in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


VIEWER_PEAK = """
import runpy, sys
runpy.run_module("canopy.tools.viewer", run_name="__main__", alter_sys=True)
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
"""


def viewer_rss_mb(run_dir: Path) -> float:
    """The peak resident memory (MB) of one rollout viewer build of `run_dir` (`python -m canopy.tools.viewer`, as
    the callback runs it), as it reads it itself at its end (a child's rusage counts its parent's memory at fork)."""
    build = [sys.executable, "-c", VIEWER_PEAK, str(run_dir), "5", "4000"]
    return int(subprocess.run(build, cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()[-1]) / 1024


def wait_for_index(log: TrajectoryLog, lines: int) -> None:
    """Until the writer process has written `lines` training steps."""
    index = log.root / "train" / INDEX
    while not index.exists() or len(index.read_text().splitlines()) < lines:
        time.sleep(0.01)


def busy_logging(writer: trajectories.Writer, episodes: list, go, working, written) -> None:
    """Write the step's logs and rebuild the viewer (every 20 steps' logs) while `go` is set, counting in
    `written`; `working` is 1 while a write is under way."""
    while True:
        go.wait()
        working.value = 1
        writer._write("train", written.value, episodes)
        written.value += 1
        if written.value % 20 == 0:
            build_viewer(writer.root.parent)
        working.value = 0


def in_process(args) -> None:
    cfg = compose_config(args.overrides)
    model_path = ensure_model(cfg)
    datamodule = build_datamodule(cfg, model_path)
    policy, _ = load_policy(model_path)
    out = Path(tempfile.mkdtemp(prefix="logging_overhead_"))  # removed at the end
    capture = datamodule.trajectory_log = Capture()
    datamodule.next_batch()  # warm-up, and one step's episodes for the busy writers
    start = datamodule.state_dict()

    def writer(name: str) -> trajectories.Writer:
        """A writer of its own folder, pruned as it grows (unsaid: the busy ones write hundreds of steps)."""
        (out / name).mkdir()
        made = trajectories.Writer(
            out / name,
            trajectories.writer_decoder(datamodule.tokenizer),
            dataclasses.replace(sampling_of(cfg.trajectories), max_disk_mb=20),
        )
        made.pruned_said = True
        return made

    one_step = {
        "thread": ThreadLog(writer("one_step_thread"), cfg.algorithm.reward),
        "process": TrajectoryLog(
            out / "one_step_process" / "trajectories",
            datamodule.tokenizer,
            model_path,
            sampling_of(cfg.trajectories),
            cfg.algorithm.reward,
        ),
    }
    context = multiprocessing.get_context("spawn")
    go = {"thread": threading.Event(), "process": context.Event()}
    working = {design: context.Value("i", 0) for design in DESIGNS}
    written = {design: context.Value("i", 0) for design in DESIGNS}
    episodes = step_episodes(capture.groups, capture.advantages, cfg.algorithm.reward)
    busy = {d: (writer(f"busy_{d}"), episodes, go[d], working[d], written[d]) for d in DESIGNS}
    threading.Thread(target=busy_logging, args=busy["thread"], daemon=True).start()
    process = context.Process(target=busy_logging, args=busy["process"], daemon=True)
    process.start()
    trajectories.lower_to_idle_priority(process.pid)  # as the trajectory log starts its writer
    handed = 0

    def step(variant: str) -> tuple[float, int, torch.Tensor]:
        """Seconds of one rollout step and update under `variant`; steps' logs the busy writer wrote meanwhile."""
        nonlocal handed
        kind, _, design = variant.partition(", ")
        datamodule.load_state_dict(start)
        datamodule.trajectory_log = one_step[design] if kind == "one step" else None
        if kind == "busy":
            go[design].set()
            while not working[design].value:  # under way (the process's first start takes seconds)
                time.sleep(0.001)
            before = written[design].value
        started = time.perf_counter()
        batch = datamodule.next_batch()
        logprobs, _ = model_token_logprobs(policy, sequence_inputs(batch), 1.0, chunk_tokens=2048)
        logprobs.mean().backward()
        policy.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        count = 0
        if kind == "busy":  # outside the time: the write under way ends
            count = written[design].value - before
            go[design].clear()
            while working[design].value:
                time.sleep(0.001)
        elif variant == "one step, thread":  # outside the time: what the step handed over is written
            one_step["thread"].wait()
        elif variant == "one step, process":
            handed += 1
            wait_for_index(one_step["process"], handed)
        return seconds, count, batch.input_ids

    variants = ["none"] + [f"{kind}, {design}" for kind in ("one step", "busy") for design in DESIGNS]
    times: dict[str, list[float]] = {v: [] for v in variants}
    counts: dict[str, list[int]] = {v: [] for v in variants}
    reference = None
    for number in range(args.rounds + 1):  # round 0 warms up (the writers' processes start) and is not counted
        for variant in variants[number % len(variants) :] + variants[: number % len(variants)]:
            seconds, count, input_ids = step(variant)
            if reference is None:
                reference = input_ids
            if not torch.equal(input_ids, reference):
                sys.exit("the replayed step sampled other episodes: the variants are not comparable")
            if number:
                times[variant].append(seconds)
                counts[variant].append(count)
        done = f"none {times['none'][-1]:.3f} s" if number else "warm-up"
        print(f"round {number}/{args.rounds}: {done}", flush=True)
    writer_rss = peak_rss_mb(one_step["process"].process.pid)  # after every round's step
    one_step["process"].close()
    viewer_rss = viewer_rss_mb(out / "one_step_process")
    training_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.thread_time()
    for _ in range(20):  # as `log_step` and the thread feeding the writer do
        pickle.dumps(("train", 0, step_episodes(capture.groups, capture.advantages, cfg.algorithm.reward)))
    handing = 1000 * (time.thread_time() - started) / 20
    print(f"\nstep (rollout + update) of {reference.shape[0]} episodes, in process, over {args.rounds} rounds:")
    base = statistics.median(times["none"])
    print(
        f"  none: {base:.3f} s (median); handing a step to the writer process costs the training process "
        f"{handing:.1f} ms of CPU (its episodes as builtins, pickled), {handing / (10 * base):.2f}% of the step"
    )
    print(f"  peak RSS: trajectory writer process {writer_rss:.0f} MB, rollout viewer build {viewer_rss:.0f} MB; "
          f"{writer_rss / training_rss:.3f} and {viewer_rss / training_rss:.3f} of the training process's "
          f"{training_rss:.0f} MB")  # fmt: skip
    for variant in variants[1:]:
        logs_ratio = [math.log(t / base) for t, base in zip(times[variant], times["none"])]
        mean, half = statistics.mean(logs_ratio), 1.96 * statistics.stdev(logs_ratio) / math.sqrt(len(logs_ratio))
        line = f"  {variant} / none: {math.exp(mean):.3f} [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]"
        if variant.startswith("busy"):
            line += f"; the busy writer wrote {statistics.mean(counts[variant]):.1f} steps' logs per step"
        print(line, flush=True)
    shutil.rmtree(out)


def logging_on(step: int, block: int, first_on: bool) -> bool:
    return (step // block % 2 == 0) == first_on


@dataclasses.dataclass(frozen=True)
class BlockSampling(Sampling):
    """The run's sampling, in the logging blocks only."""

    block: int = 10
    first_on: bool = True

    def groups(self, stream, step, groups):
        return super().groups(stream, step, groups) if logging_on(step, self.block, self.first_on) else []


class AlternatingLogs(L.Callback):
    """Added to the run by `+callbacks.alternating_logs`: the trajectory log and the viewer work in every other
    block of `block` steps (from the first block when `first_on`)."""

    def __init__(self, block: int, first_on: bool):
        self.block, self.first_on = block, first_on

    def setup(self, trainer, pl_module, stage) -> None:
        log = trainer.datamodule.trajectory_log
        log.sampling = BlockSampling(**dataclasses.asdict(log.sampling), block=self.block, first_on=self.first_on)
        viewer = next(c for c in trainer.callbacks if isinstance(c, RolloutViewer))
        viewer.every_n_steps = self.block
        rebuild = viewer.on_train_batch_end

        def on_train_batch_end(trainer, *args):
            if logging_on(trainer.global_step, self.block, self.first_on):
                rebuild(trainer, *args)

        viewer.on_train_batch_end = on_train_batch_end


def step_seconds(run_dir: Path) -> dict[int, float]:
    """Each step's wall time: from the previous step's `actor/loss` event to its own."""
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload().Scalars("actor/loss")
    return {b.step: b.wall_time - a.wall_time for a, b in zip(events, events[1:])}


def logging_work(run_dir: Path, block: int) -> tuple[float, float]:
    """(writer CPU ms per logged step, viewer CPU ms per logged step): the index's `write_cpu_ms`, and one viewer
    build timed here over the run's logs (as the callback builds it, once per block)."""
    writer = statistics.mean(line["write_cpu_ms"] for line in read_index(run_dir / "trajectories" / "train"))
    started = time.thread_time()
    build_viewer(run_dir)
    return writer, 1000 * (time.thread_time() - started) / block


def train(run_dir: Path, args, first_on: bool) -> dict[int, float]:
    command = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={args.steps}",
        "report.eval_samples_per_task=0",
        "eval.every_n_steps=0",
        "+callbacks.alternating_logs._target_=bench.logging_overhead.AlternatingLogs",
        f"+callbacks.alternating_logs.block={args.block}",
        f"+callbacks.alternating_logs.first_on={first_on}",
        *args.overrides,
    ]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    return step_seconds(run_dir)


def block_log_ratios(first: dict[int, float], second: dict[int, float], args) -> dict[bool, list[float]]:
    """Per block past `--skip`, the mean over its steps (but the first) of log(with logs / without), by whether the
    first run (`first_on`) logged in it."""
    blocks: dict[int, list[float]] = {}
    for step in sorted(first):
        if step < args.skip or step % args.block == 0 or step not in second:
            continue
        ratio = math.log(first[step] / second[step])
        blocks.setdefault(step // args.block, []).append(ratio if logging_on(step, args.block, True) else -ratio)
    phases: dict[bool, list[float]] = {True: [], False: []}
    for block, values in blocks.items():
        phases[logging_on(block * args.block, args.block, True)].append(statistics.mean(values))
    return phases


def pair_estimate(phases: dict[bool, list[float]]) -> tuple[float, float]:
    """(log ratio, its variance) of one pair of runs: the mean of the two phases' means, in which the runs' own
    speed ratio enters once with each sign and cancels, however many blocks each phase has."""
    means = [statistics.mean(v) for v in phases.values()]
    variances = [statistics.variance(v) / len(v) if len(v) > 1 else float("nan") for v in phases.values()]
    return sum(means) / 2, sum(variances) / 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40, help="rounds of the in-process variants")
    parser.add_argument("--end-to-end", action="store_true", help="also time two train.py runs in blocks")
    parser.add_argument("--steps", type=int, default=70, help="steps per run")
    parser.add_argument("--skip", type=int, default=10, help="steps left out (start-up)")
    parser.add_argument("--block", type=int, default=10, help="steps per block with or without logs")
    parser.add_argument("--repeats", type=int, default=2, help="how many pairs of runs (in order A B, B A, ...)")
    parser.add_argument("--keep", type=Path, help="keep the runs in this folder (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (for an interval)")
    in_process(args)
    if args.end_to_end:
        end_to_end(args)


def end_to_end(args) -> None:
    estimates, shares = [], []
    with tempfile.TemporaryDirectory() as scratch:
        out = args.keep or scratch
        for number in range(args.repeats):
            runs = {}
            for first_on in (True, False) if number % 2 == 0 else (False, True):
                run_dir = Path(out) / f"pair{number}_{'on' if first_on else 'off'}_first"
                runs[first_on] = (run_dir, train(run_dir, args, first_on))
            phases = block_log_ratios(runs[True][1], runs[False][1], args)
            estimates.append(pair_estimate(phases))
            step = statistics.mean(runs[False][1].values())
            writer, viewer = logging_work(runs[True][0], args.block)
            shares.append((writer + viewer) / (1000 * step))
            print(
                f"pair {number}: {step:.3f} s per step; with logs / without: {math.exp(estimates[-1][0]):.3f} "
                f"(per block, the first run logging: {' '.join(f'{math.exp(r):.3f}' for r in phases[True])}; the "
                f"second: {' '.join(f'{math.exp(r):.3f}' for r in phases[False])}); logging work per step: writer "
                f"{writer:.1f} ms + viewer {viewer:.1f} ms CPU",
                flush=True,
            )
    mean = statistics.mean(e for e, _ in estimates)
    half = 1.96 * math.sqrt(sum(v for _, v in estimates)) / len(estimates)  # nan with a single block in a phase
    print(
        f"\nend to end, step time with trajectory logs and viewer / without: {math.exp(mean):.3f} "
        f"[95% interval: {math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]\n"
        f"the logging's own CPU work per step / step time: {100 * statistics.mean(shares):.2f}% "
        f"(the writer process and the viewer builds, counted directly; spent outside the training process)"
    )


if __name__ == "__main__":
    main()
