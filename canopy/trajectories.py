"""Trajectory logs: what the agent did, step by step, as compressed JSONL (read by the viewer and `replay`).

Each logged rollout step, and each evaluation, becomes one file `<run>/trajectories/<stream>/step_<N>.jsonl.gz`
(stream `train`, or `eval_<budget>`), one episode per line: its task (id, tier, scenario), sample index and group,
the weight versions that sampled it, each turn's decoded action and observation with their token counts, the actions
the environment answered and the turns whose action was invalid for it, how it ended, its verdict, reward and group
advantage (Eq. 3) or the fault that quarantined it, and, for `replay`, its token ids with the action mask as run
lengths.

Sampling keeps a large run's logs small: every `every_n_steps`-th training step (every evaluation), only the groups
of the named `tasks`, or the first `groups_per_tier` groups of each tier; `max_disk_mb` bounds the folder, the oldest
step files going first (said once). Records are built and written by a process of their own at idle priority
(`python -m canopy.trajectory_writer`, which imports neither torch nor the training code), so a training step only
hands its episodes over; each file appears whole (written under a temporary name, then renamed) or not at all.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from canopy.coverage import group_composition
from canopy.errors import ConfigError, is_int

if TYPE_CHECKING:
    from canopy.rollout.trajectory import Trajectory

META = "meta.json"  # the tokenizer's path (for `replay`), written once per log folder
INDEX = "index.jsonl"  # per stream: one summary line per logged step (the viewer's curves)


@dataclass(frozen=True)
class Sampling:
    """Which episodes are logged: `trajectories.*` as `sampling_of` reads it (conf/train.yaml holds the defaults)."""

    every_n_steps: int
    tasks: tuple[str, ...] | None  # only these tasks' groups
    groups_per_tier: int | None  # only the first k groups of each tier, per step
    token_ids: bool  # keep ids and mask for `replay` (the text alone is several times smaller)
    max_disk_mb: float

    def groups(self, stream: str, step: int, groups: list[list[Trajectory]]) -> list[int]:
        """The indices of the step's groups to log (`every_n_steps` thins the training steps; evaluations are rare
        enough to keep each)."""
        if stream == "train" and step % self.every_n_steps:
            return []
        chosen = [g for g, group in enumerate(groups) if self.tasks is None or group[0].task.task_id in self.tasks]
        if self.groups_per_tier is None:
            return chosen
        taken: dict[int, int] = {}
        kept = []
        for g in chosen:
            tier = groups[g][0].task.tier
            if taken.get(tier, 0) < self.groups_per_tier:
                taken[tier] = taken.get(tier, 0) + 1
                kept.append(g)
        return kept


@dataclass
class TrajectorySettings:
    """`trajectories.*`: the schema (conf/train.yaml holds the defaults); `sampling_of` checks and reads it."""

    enabled: bool
    every_n_steps: int
    tasks: list[str] | None
    groups_per_tier: int | None
    token_ids: bool
    max_disk_mb: float

    def validate(self) -> None:
        sampling_of(self)


def sampling_of(section) -> Sampling | None:
    """The config's `trajectories` section as `Sampling` (None when disabled), each key checked with its fix."""

    if not section.enabled:
        return None
    positive = lambda value: is_int(value) and value >= 1  # noqa: E731
    if not positive(section.every_n_steps):
        raise ConfigError(f"trajectories.every_n_steps={section.every_n_steps} must be a positive integer")
    if section.groups_per_tier is not None and not positive(section.groups_per_tier):
        raise ConfigError(f"trajectories.groups_per_tier={section.groups_per_tier} must be null (all) or >= 1")
    tasks = section.tasks
    if tasks is not None and (isinstance(tasks, str) or not all(isinstance(t, str) for t in tasks)):
        raise ConfigError(f"trajectories.tasks={tasks!r} must be null or a list of task ids, e.g. '[vault0_s0_t3]'")
    if isinstance(section.max_disk_mb, bool) or not isinstance(section.max_disk_mb, (int, float)):
        raise ConfigError(f"trajectories.max_disk_mb={section.max_disk_mb!r} must be a number of megabytes")
    if section.max_disk_mb <= 0:
        raise ConfigError(
            f"trajectories.max_disk_mb={section.max_disk_mb} must be > 0 (trajectories.enabled=false "
            "turns the logs off)"
        )
    return Sampling(
        every_n_steps=section.every_n_steps,
        tasks=None if tasks is None else tuple(tasks),
        groups_per_tier=section.groups_per_tier,
        token_ids=bool(section.token_ids),
        max_disk_mb=float(section.max_disk_mb),
    )


def mask_runs(mask: list[int]) -> list[int]:
    """The action mask as run lengths, starting with a run of 0s (possibly empty): [0,0,1,1,1,0] -> [2, 3, 1]."""
    runs, current, length = [], 0, 0
    for value in mask:
        if value != current:
            runs.append(length)
            current, length = value, 0
        length += 1
    runs.append(length)
    return runs


def expand_runs(runs: list[int]) -> list[int]:
    """The inverse of `mask_runs`."""
    return [i % 2 for i, length in enumerate(runs) for _ in range(length)]


def plain_episode(group: int, t: Trajectory, advantage: float | None, reward_kind: str) -> dict:
    """What the writer needs of an episode, in builtins only: unpickling it then imports neither torch nor the
    rollout code. `advantage` is its group advantage (Eq. 3), None if it has none."""
    verdict = t.verdict
    return {
        "task_id": t.task.task_id,
        "tier": t.task.tier,
        "scenario": t.task.scenario,
        "sample_index": t.sample_index,
        "group": group,
        "weight_versions": sorted(t.weight_versions),
        "prompt_tokens": t.prompt_length,
        "response_tokens": t.response_tokens,
        "num_turns": t.num_turns,
        "actions": t.actions,
        "invalid_turns": list(t.invalid_turns),
        "ending": t.ending,
        "verdict": None if verdict is None else {**verdict.__dict__, "success": verdict.success},
        "agent_failure": t.agent_failure,
        "quarantine": t.quarantine,
        "fault": None if t.fault is None else str(t.fault),
        "reward": None if t.quarantine is not None else t.reward(reward_kind),
        "advantage": advantage,
        "token_ids": t.token_ids,
        "action_mask": t.action_mask,
    }


def plain_episodes(groups: list[list[Trajectory]], chosen, advantages: dict | None, reward_kind: str) -> list[dict]:
    """The episodes of the `chosen` groups as the writer is handed them (`plain_episode`); `advantages` by `id`."""
    advantages = advantages or {}
    return [plain_episode(g, t, advantages.get(id(t)), reward_kind) for g in chosen for t in groups[g]]


def episode_records(episodes: list[dict], decoder, *, step: int, token_ids: bool) -> list[dict]:
    """The step's episodes (`plain_episode`) as JSON-ready dicts: the prompt, then per turn the action (mask 1) and
    the observation that followed it (mask 0), decoded with the special tokens kept, so the text is what the model
    saw. Every piece of the step is decoded in one call (`decode_all`)."""
    layouts, pieces = [], []
    for e in episodes:
        runs = mask_runs(e["action_mask"])  # the first run (0s) holds the prompt: the prompt's mask is all 0
        spans, position = [], e["prompt_tokens"]
        for run, length in enumerate([runs[0] - e["prompt_tokens"], *runs[1:]]):  # even runs: 0s, odd: 1s
            if length:
                spans.append((run % 2 == 1, length))
                pieces.append(e["token_ids"][position : position + length])
            position += length
        pieces.append(e["token_ids"][: e["prompt_tokens"]])
        layouts.append((runs, spans))
    texts = iter(decode_all(decoder, pieces))
    records = []
    for e, (runs, spans) in zip(episodes, layouts):
        turns = []
        for is_action, length in spans:
            text = next(texts)
            if is_action:
                turns.append({"action": text, "action_tokens": length, "observation": "", "observation_tokens": 0})
            elif turns:  # an observation follows its action (nothing is shown before the first)
                turns[-1].update(observation=text, observation_tokens=length)
        record = {
            "step": step,
            "task_id": e["task_id"],
            "tier": e["tier"],
            "scenario": e["scenario"],
            "sample_index": e["sample_index"],
            "group": e["group"],
            "weight_versions": e["weight_versions"],
            "prompt": next(texts),
            "prompt_tokens": e["prompt_tokens"],
            "response_tokens": e["response_tokens"],
            "num_turns": e["num_turns"],
            "actions": e["actions"],
            "invalid_turns": e["invalid_turns"],
            "turns": turns,
            "ending": e["ending"],
            "verdict": e["verdict"],
            "agent_failure": e["agent_failure"],
            "quarantine": e["quarantine"],
            "fault": e["fault"],
            "reward": e["reward"],
            "advantage": e["advantage"],
        }
        if token_ids:
            record["token_ids"], record["mask_runs"] = list(e["token_ids"]), runs
        records.append(record)
    return records


def lower_to_idle_priority(pid: int = 0) -> None:
    """Put a thread (0: the calling one; else a process's main thread, whose later threads inherit it) in Linux's
    idle scheduling class (SCHED_IDLE; else at nice 19): it then runs on the CPU time the training leaves, never
    taking a core from torch's intra-op threads. A no-op off Linux."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, pid or threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass


def writer_decoder(tokenizer):
    """What the writer decodes with: the fast tokenizer's Rust backend where that gives `decode`'s text (no clean-up
    of spaces), which the writer process unpickles without transformers; else the tokenizer itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer
    return backend


def decode_all(decoder, pieces: list[list[int]]) -> list[str]:
    """Each piece's text as `tokenizer.decode(piece, skip_special_tokens=False)` gives it. A Rust backend
    (`writer_decoder`) decodes them all in one call: per call, `decode`'s Python overhead costs more than the
    decoding of a short turn."""
    from tokenizers import Tokenizer

    if isinstance(decoder, Tokenizer):
        return decoder.decode_batch(pieces, skip_special_tokens=False)
    return [decoder.decode(piece, skip_special_tokens=False) for piece in pieces]


class TrajectoryLog:
    """Hands the sampled episodes of each step to a writer process (`python -m canopy.trajectory_writer`, started
    by the first step handed over, at idle priority; only the generating rank ever logs), which writes them under
    `root/<stream>/`. A step costs the training process only copying out and pickling its episodes (about 1 ms for
    128; the pickling on a thread feeding the writer's stdin): in a thread, building and encoding the records held
    the GIL the training loop needs. What the writer has to say (a step not written, old steps pruned) is said
    here, at the next step or at `close`, which waits for what is queued."""

    def __init__(self, root: str | Path, tokenizer, tokenizer_path: str, sampling: Sampling, reward_kind: str):
        self.root, self.tokenizer, self.sampling, self.reward_kind = Path(root), tokenizer, sampling, reward_kind
        self.tokenizer_path = str(tokenizer_path)
        self.pruned_warned = False
        self.process = None
        self.queue = self.said = self.listener = None

    def _start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / META).write_text(json.dumps({"tokenizer": self.tokenizer_path}))
        home = str(Path(__file__).parents[1])  # the writer imports this canopy, whatever the working folder
        path = os.pathsep.join(p for p in (home, os.environ.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "canopy.trajectory_writer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
        lower_to_idle_priority(self.process.pid)  # from its first import on
        self.queue = queue.Queue(maxsize=4)  # a slow disk holds back the run, never drops a step
        self.said = queue.Queue()
        self.queue.put(Writer(self.root, writer_decoder(self.tokenizer), self.sampling))
        threading.Thread(target=feed, args=(self.queue, self.process.stdin), daemon=True).start()
        self.listener = threading.Thread(target=listen, args=(self.process.stdout, self.said), daemon=True)
        self.listener.start()

    def log_step(
        self,
        stream: str,
        step: int,
        groups: list[list[Trajectory]],
        advantages: dict[int, float] | None = None,
    ) -> None:
        """Hand over one step's groups; `advantages` maps id(trajectory) to its Eq. 3 advantage (training only)."""
        chosen = self.sampling.groups(stream, step, groups)
        if not chosen:
            return
        episodes = plain_episodes(groups, chosen, advantages, self.reward_kind)
        if self.process is None:
            self._start()
        self._hand_over((stream, step, episodes))
        self._say()

    def close(self) -> None:
        """Write what is queued, then stop the writer (a later step starts another)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._hand_over(None)
        else:
            if self.process.returncode:
                warnings.warn(f"{self._died()}: what it had queued was not written", stacklevel=2)
            with contextlib.suppress(queue.Full):  # a full queue: its feeding thread has stopped already
                self.queue.put_nowait(None)  # stops the feeding thread
        self.process.wait()
        self.listener.join()  # to the writer's last word
        self.process.stdout.close()
        self._say()
        self.process = None

    def _hand_over(self, item) -> None:
        """Queue `item` for the writer, waiting while the queue is full; a writer that has died stops the run."""
        while self.process.poll() is None:
            try:
                return self.queue.put(item, timeout=1.0)
            except queue.Full:
                continue
        raise RuntimeError(f"{self._died()}; trajectories.enabled=false runs without the logs")

    def _died(self) -> str:
        return f"the trajectory writer process died (exit code {self.process.returncode})"

    def _say(self) -> None:
        """Warn here what the writer reported: each step not written, the disk bound once."""
        while True:
            try:
                kind, message = self.said.get_nowait()
            except queue.Empty:
                return
            if kind == "pruned" and self.pruned_warned:
                continue
            self.pruned_warned |= kind == "pruned"
            warnings.warn(message, stacklevel=3)


def feed(items: queue.Queue, pipe) -> None:
    """Pickle each queued item into the writer's stdin until None, which closes it (the writer's end of input); a
    writer that has died stops the feeding (the log then says it died)."""
    try:
        with pipe:
            while (item := items.get()) is not None:
                pickle.dump(item, pipe)
                pipe.flush()
                items.task_done()
    except BrokenPipeError:  # the writer died (the log says so)
        pass


def listen(pipe, said: queue.Queue) -> None:
    """Queue what the writer says (a JSON line each: [kind, message]) until it exits."""
    for line in pipe:
        said.put(tuple(json.loads(line)))


class Writer:
    """The writer process: builds each step's records and writes them whole (a temporary name, then renamed), with
    a line per step in the stream's index; keeps the folder under `max_disk_mb`."""

    def __init__(self, root: Path, decoder, sampling: Sampling):
        self.root, self.decoder, self.sampling = root, decoder, sampling
        self.sizes: dict[Path, int] = {}
        self.pruned_said = False

    def run(self, steps, said) -> None:
        """Write each step unpickled from `steps` until None or the end of input (the training process was killed:
        what it had handed over is written, nothing more comes); say on `said` (a text stream) what went wrong."""
        self.sizes = {p: p.stat().st_size for p in self.root.glob("*/step_*.jsonl.gz")}  # a resumed run's too
        self.said = said
        while True:
            try:
                item = pickle.load(steps)
            except (EOFError, pickle.UnpicklingError):  # a step cut short by the training process's death
                return
            if item is None:
                return
            stream, step, episodes = item
            try:
                self._write(stream, step, episodes)
            except Exception as error:  # noqa: BLE001 (a logging failure must not stop training; it is said)
                self._say("failed", f"trajectory log: step {step} of {stream} was not written: {error}")

    def _say(self, kind: str, message: str) -> None:
        self.said.write(json.dumps([kind, message]) + "\n")
        self.said.flush()

    def _write(self, stream: str, step: int, episodes: list[dict]) -> None:
        started = time.thread_time()  # the writer's CPU time: what the logs cost, kept in the index line
        folder = self.root / stream
        folder.mkdir(exist_ok=True)
        path = step_path(folder, step)
        staged = path.with_name(f".{path.name}.tmp")
        records = episode_records(episodes, self.decoder, step=step, token_ids=self.sampling.token_ids)
        with gzip.open(staged, "wt", encoding="utf-8", compresslevel=1) as out:
            out.writelines(json.dumps(record) + "\n" for record in records)
        staged.replace(path)
        with open(folder / INDEX, "a", encoding="utf-8") as index:  # one line per step, kept when its file is pruned
            cpu_ms = round(1000 * (time.thread_time() - started), 3)
            index.write(json.dumps({**step_summary(step, records), "write_cpu_ms": cpu_ms}) + "\n")
        self.sizes[path] = path.stat().st_size
        self._bound_disk(keep=path)

    def _bound_disk(self, keep: Path) -> None:
        """Remove the oldest step files (by step, then stream) while the folder is over `max_disk_mb`."""
        limit = self.sampling.max_disk_mb * 2**20
        for oldest in sorted(self.sizes, key=lambda p: (p.name, p.parent.name)):
            if sum(self.sizes.values()) <= limit or oldest == keep:
                break
            if not self.pruned_said:
                self._say(
                    "pruned",
                    f"trajectory logs over trajectories.max_disk_mb={self.sampling.max_disk_mb}: removing the oldest "
                    f"step files, from {oldest.parent.name}/{oldest.name} on (sample fewer episodes to keep them all)",
                )
                self.pruned_said = True
            oldest.unlink(missing_ok=True)
            del self.sizes[oldest]


def step_summary(step: int, records: list[dict]) -> dict:
    """A logged step in one line: its episodes, quarantined ones, successes of the scored ones by tier (successes,
    scored), their invalid actions (invalid, answered: format health), and its groups by composition (Fig. 3:
    all_fail / mixed / all_success, `empty` if all quarantined)."""
    by_tier: dict[int, list[int]] = {}
    groups: dict[int, list[bool]] = {}
    invalid_actions = [0, 0]
    for r in records:
        outcomes = groups.setdefault(r["group"], [])
        if r["quarantine"] is None:
            success = bool(r["verdict"] and r["verdict"]["success"])
            counts = by_tier.setdefault(r["tier"], [0, 0])
            counts[0] += int(success)
            counts[1] += 1
            outcomes.append(success)
            invalid_actions[0] += len(r.get("invalid_turns", ()))  # logs written before format health: none
            invalid_actions[1] += r.get("actions", 0)
    kinds = Counter(group_composition(sum(o), len(o)) if o else "empty" for o in groups.values())
    return {
        "step": step,
        "episodes": len(records),
        "quarantined": sum(r["quarantine"] is not None for r in records),
        "success_by_tier": {str(tier): counts for tier, counts in sorted(by_tier.items())},
        "invalid_actions": invalid_actions,
        "groups": dict(kinds),
        "mean_turns": sum(r["num_turns"] for r in records) / max(1, len(records)),
    }


def read_index(folder: str | Path) -> list[dict]:
    """A stream's step summaries in step order, the last line winning for a step logged twice (a resumed run)."""
    path = Path(folder) / INDEX
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            summary = json.loads(line)
        except json.JSONDecodeError:  # the line a killed run was writing
            continue
        by_step[summary["step"]] = summary
    return [by_step[step] for step in sorted(by_step)]


def step_path(folder: str | Path, step: int) -> Path:
    """Where a stream folder keeps one step's episodes."""
    return Path(folder) / f"step_{step:06d}.jsonl.gz"


def step_files(folder: str | Path) -> dict[int, Path]:
    """A stream folder's step files by step, in step order."""
    return {int(p.name[5:11]): p for p in sorted(Path(folder).glob("step_*.jsonl.gz"))}


def read_step(path: str | Path) -> list[dict]:
    """The episodes of one step file."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]
