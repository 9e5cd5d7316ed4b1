"""The environment serving layer: a pool of isolated worker processes with fault attribution (Appendix G).

`EnvironmentPool` is an `Environment` whose episodes each run in a worker process of their own (one episode
per worker at a time, so concurrent episodes never share state). Every request has a timeout; a worker is
health-checked before it takes an episode and replaced when it fails one; a worker that faulted, died or
served `max_episodes_per_worker` episodes is killed (with everything its sandbox left) and replaced. A
replacement that fails to start leaves its slot vacant: the next episode to take the slot starts it again, and
is quarantined (`worker_start_failed`) if that fails too, so the pool never shrinks and never waits forever.

Each worker has a home of its own under the pool's scratch folder (`private_home`): nothing an environment's
libraries create on first use lands in the user's home. Its stderr goes to `<scratch>/logs/worker<slot>.log`;
the log of a worker that faulted is kept in `log_dir` (default `<tmp>/canopy-fault-logs`, the run's
`env_logs/` in training) and named in the fault. Sandboxes a worker starts through `canopy.envs.isolation` carry
its slot's tag: stopping the worker (also after kill -9) removes their cgroups and containers.

The pool holds its scratch folder's owner lock while it runs (`canopy.envs.scratch`). A pool killed before `close()`
(kill -9, the OOM killer, a preempted job) leaves the lock free; its workers close their episodes and exit, and the
next pool to start on the machine removes the folder and what its slots' sandboxes left (`sweep_abandoned_scratch`).

Fault attribution: the agent's own endings come back from the worker as `AgentFailure` (scored 0). What the
layer attributes to itself raises `EnvironmentFault` and quarantines the episode:
  worker_killed            the worker died of SIGKILL (kill -9, the kernel's OOM killer)
  worker_crashed           the worker died of anything else
  worker_unresponsive      a request outlived its timeout (the worker hangs or is stopped)
  worker_oom               the environment's own code exceeded the worker's memory cap
  environment_error        the environment's code raised (a bug in the environment)
  cross_episode_corruption the worker answered for, or still held, another episode
  sandbox_setup_failed     the sandbox for the agent's code could not be built
  worker_start_failed      a replacement worker could not be started for the episode
"""

import itertools
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from canopy.envs.attribution import POOL_SCRATCH
from canopy.envs.base import (
    AgentFailure,
    EnvironmentFault,
    SystemicFaultError,
    Task,
    keep_fault_log,
    last_line,
)
from canopy.envs.isolation import SLOT_TAG, release_slot
from canopy.envs.isolation.base import remove_tree
from canopy.envs.remote import RemoteEpisode
from canopy.envs.sandbox import SandboxLimits, claim_uid, kill_uid, private_home
from canopy.envs.scratch import SCRATCH_PREFIX, claim_scratch, slot_tag, sweep_abandoned_scratch
from canopy.envs.worker import read_frame, write_frame
from canopy.errors import is_int, require

OPERATIONS = ("start", "step", "verdict", "close")


@dataclass(frozen=True)
class PoolSettings:
    """`env.pool.*`, the serving layer (Appendix G): the schema and the only defaults of those keys."""

    workers: int = 0  # 0 = in-process environment (the embedded default); N = N worker processes, one episode each
    memory_mb: int = 4096  # address-space cap of each worker (its sandboxes have their own, smaller one)
    request_timeout_s: float = 120.0  # a worker silent this long is unresponsive: its episode is quarantined; must
    # exceed the sandbox's wall-time limit
    health_timeout_s: float = 10.0
    start_timeout_s: float = 300.0
    max_episodes_per_worker: int = 200  # recycle workers to bound leaks
    operation_timeouts_s: dict[str, float] = field(default_factory=dict)  # start | step | verdict | close -> s,
    # else request_timeout_s (a SWE-bench step takes seconds, its grading minutes)

    def timeout(self, op: str) -> float:
        """How long a request `op` may take before its worker is unresponsive (a SWE-bench step takes seconds,
        its grading minutes)."""
        return self.operation_timeouts_s.get(op, self.request_timeout_s)

    def validate(self, sandbox: SandboxLimits) -> None:
        """`env.pool.*` (and the sandbox's limits, which must fit inside a worker's): one line naming the fix on the
        first bad value."""

        require(
            is_int(self.workers) and self.workers >= 0,
            f"env.pool.workers={self.workers} must be 0 (in-process environment) or the number of worker processes",
        )
        for key in ("request_timeout_s", "health_timeout_s", "start_timeout_s", "memory_mb", "max_episodes_per_worker"):
            require(getattr(self, key) > 0, f"env.pool.{key}={getattr(self, key)} must be > 0")
        for op, timeout in self.operation_timeouts_s.items():
            require(
                op in OPERATIONS and timeout > 0,
                f"env.pool.operation_timeouts_s.{op}={timeout}: use {', '.join(OPERATIONS)} with seconds > 0",
            )
        sandbox.validate()
        require(
            self.request_timeout_s > sandbox.wall_seconds + 5,
            f"env.pool.request_timeout_s={self.request_timeout_s} must exceed env.sandbox.wall_seconds="
            f"{sandbox.wall_seconds} by > 5 s, or the agent's slow code would be blamed on the worker",
        )
        require(
            self.memory_mb > sandbox.memory_mb,
            f"env.pool.memory_mb={self.memory_mb} must exceed env.sandbox.memory_mb={sandbox.memory_mb}: the "
            "worker hosts the sandbox",
        )


class Worker:
    """One worker process and its private channel."""

    def __init__(
        self,
        factory: str,
        kwargs: dict,
        settings: PoolSettings,
        slot: int,
        scratch_root: Path,
        claim: tuple[int, int] | None,
        log_dir: Path,
    ):
        """`claim`: the sandbox uid and its lock fd (`claim_uid`), or None when not root. The worker inherits the
        lock, so the uid stays claimed while the worker lives: a worker orphaned by its pool's kill -9 still ends
        its sandbox by killing every process of its uid, which must not be another run's by then."""
        self.slot, self.settings, self.episodes_served, self.log_dir = slot, settings, 0, log_dir
        self.uid = claim[0] if claim else None
        self.scratch = scratch = scratch_root / f"w{slot}"
        self.tag = slot_tag(scratch)
        self.log = scratch_root / "logs" / f"worker{slot}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            **private_home(scratch / "home"),
            "CANOPY_SANDBOX_UID": str(self.uid or ""),
            "CANOPY_SCRATCH_ROOT": str(scratch),
            POOL_SCRATCH: str(scratch_root),
            "CANOPY_FAULT_LOG_DIR": str(log_dir),
            SLOT_TAG: self.tag,
        }
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "canopy.envs.worker", factory, json.dumps(kwargs), str(settings.memory_mb)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
                pass_fds=(claim[1],) if claim else (),
            )
        self.pid = self.process.pid
        self.broken = False
        try:
            self.request("ready", None, (), settings.start_timeout_s, send=False)
        except EnvironmentFault:
            self.stop()
            raise

    def request(self, op: str, episode_id: str | None, args: tuple, timeout: float, send: bool = True):
        """Send one request and wait for its reply; faults of the worker raise `EnvironmentFault`."""
        try:
            if send:
                write_frame(self.process.stdin.fileno(), (op, episode_id, args))
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                raise self._fault("worker_unresponsive", f"no reply to {op!r} within {timeout:.0f} s")
            reply = read_frame(self.process.stdout.fileno())
        except (BrokenPipeError, EOFError):
            raise self._fault(*self._death())
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "agent_failure":
            raise AgentFailure(reply[1], reply[2])
        raise self._fault(reply[1], reply[2])

    def _fault(self, reason: str, detail: str) -> EnvironmentFault:
        """The fault, with the worker's last log line and a kept copy of its log when it died or hung."""
        self.broken = True
        if reason in ("worker_killed", "worker_crashed", "worker_unresponsive"):
            kept = keep_fault_log(self.log, f"worker{self.slot}-pid{self.pid}.log", self.log_dir)
            detail += f"; last log line: {last_line(self.log.read_text(errors='replace'))} (worker log: {kept})"
        return EnvironmentFault(reason, f"worker {self.slot} (pid {self.pid}): {detail}", worker=self.slot)

    def _death(self) -> tuple[str, str]:
        try:
            code = self.process.wait(timeout=self.settings.health_timeout_s)
        except subprocess.TimeoutExpired:
            return "worker_unresponsive", "closed its channel but did not exit"
        if code == -signal.SIGKILL:
            return "worker_killed", "died of SIGKILL"
        return "worker_crashed", f"exited with status {code}"

    def healthy(self) -> bool:
        try:
            return self.request("ping", None, (), self.settings.health_timeout_s) == self.pid
        except EnvironmentFault:
            return False

    def stop(self) -> None:
        """Kill the worker, its sandboxes and everything they left behind."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()
        if self.uid is not None:
            kill_uid(self.uid)
        release_slot(self.tag, self.scratch)


class EnvironmentPool:
    """An `Environment` served by `settings.workers` isolated worker processes (see the module docstring)."""

    name: str  # pool:<factory>
    max_concurrent_episodes: int  # settings.workers: one episode per worker at a time

    def __init__(
        self,
        factory: str,
        kwargs: dict,
        settings: PoolSettings,
        scratch_root: str | Path | None = None,
        log_dir: str | Path | None = None,
    ):
        """Cheap: the workers start on first use (and again after `close()`)."""
        self.factory, self.kwargs, self.settings = factory, kwargs, settings
        self.name = f"pool:{factory}"
        self.max_concurrent_episodes = settings.workers
        self.scratch_root = Path(
            scratch_root or Path(tempfile.gettempdir()) / f"{SCRATCH_PREFIX}{os.getpid()}-{id(self):x}"
        )
        self.log_dir = Path(log_dir or Path(tempfile.gettempdir()) / "canopy-fault-logs").absolute()
        self.repairs = 0  # workers replaced after a failed health check
        self._idle: queue.Queue[int] = queue.Queue()  # slots free for an episode: an idle worker's, or a vacant one
        self._episode_ids = itertools.count()
        self._lock = threading.Lock()  # guards _workers
        self._starting = threading.Lock()  # one thread starts the workers; the others wait for it
        self._started = False
        self._workers: dict[int, Worker] = {}  # slot -> its live worker; a vacant slot has none
        self._uids: dict[int, tuple[int, int]] = {}  # slot -> (sandbox uid, its lock fd), held while workers run
        self._owner_lock: int | None = None  # the scratch folder's (`claim_scratch`), held while workers run

    def _start_workers(self) -> None:
        """Start every worker, once: on first use, and on first use after `close()`. A worker that cannot start
        now is a broken setup, not a fault to quarantine: it stops the run with the worker's own error."""
        with self._starting:
            if self._started:
                return
            if self._owner_lock is None:
                sweep_abandoned_scratch(self.scratch_root.parent)
                self._owner_lock = claim_scratch(self.scratch_root)
            for slot in range(self.settings.workers):
                if os.geteuid() == 0:
                    self._uids[slot] = claim_uid()
                try:
                    self._spawn(slot)
                except EnvironmentFault as fault:
                    raise SystemicFaultError(
                        f"environment worker for {self.factory} failed to start: {fault}"
                    ) from None
                self._idle.put(slot)
            self._started = True

    def _spawn(self, slot: int) -> Worker:
        worker = Worker(
            self.factory, self.kwargs, self.settings, slot, self.scratch_root, self._uids.get(slot), self.log_dir
        )
        with self._lock:
            self._workers[slot] = worker
        return worker

    def _retire(self, worker: Worker) -> None:
        """Kill the worker and clear its scratch; its slot is vacant until a new worker starts there."""
        with self._lock:
            self._workers.pop(worker.slot, None)
        worker.stop()
        remove_tree(self.scratch_root / f"w{worker.slot}")

    def _acquire(self) -> Worker:
        self._start_workers()
        while True:
            slot = self._idle.get()
            with self._lock:
                worker = self._workers.get(slot)
            if worker is None:
                try:
                    return self._spawn(slot)
                except EnvironmentFault as fault:
                    self._idle.put(slot)
                    raise EnvironmentFault("worker_start_failed", str(fault), worker=slot) from None
            if worker.healthy():
                return worker
            self.repairs += 1
            self._retire(worker)
            self._idle.put(slot)

    def release(self, worker: Worker) -> None:
        if worker.broken or worker.episodes_served >= self.settings.max_episodes_per_worker:
            self._retire(worker)
            try:
                self._spawn(worker.slot)  # ready before the next episode asks
            except EnvironmentFault:
                pass  # the slot stays vacant: the next episode that takes it starts it (see `_acquire`)
        self._idle.put(worker.slot)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [worker.pid for worker in self._workers.values()]

    def tasks(self, split: str) -> list[Task]:
        worker = self._acquire()
        try:
            return worker.request("tasks", None, (split,), self.settings.request_timeout_s)
        finally:
            self.release(worker)

    def start(self, task: Task, seed: int) -> RemoteEpisode:
        """The episode, pinned to one worker (its `host`) until `close()` hands the worker back."""
        worker = self._acquire()
        episode_id = f"{task.task_id}#{next(self._episode_ids)}"
        worker.episodes_served += 1
        try:
            messages = worker.request("start", episode_id, (task, seed), self.settings.timeout("start"))
        except BaseException:
            self.release(worker)
            raise
        return RemoteEpisode(episode_id, messages, worker, self._request, self._end)

    def _request(self, worker: Worker, episode_id: str, op: str, *args):
        return worker.request(op, episode_id, args, self.settings.timeout(op))

    def _end(self, worker: Worker, episode_id: str) -> None:
        """Close the episode on its worker (a worker that fails to is broken: retired), and hand the worker back."""
        if not worker.broken:
            try:
                self._request(worker, episode_id, "close")
            except (EnvironmentFault, AgentFailure):
                worker.broken = True
        self.release(worker)

    def close(self) -> None:
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.stop()
        for _, lock in self._uids.values():
            os.close(lock)
        self._uids.clear()
        self._idle = queue.Queue()
        self._started = False
        if self._owner_lock is not None:  # a folder this pool claimed, never another's
            remove_tree(self.scratch_root)
            os.close(self._owner_lock)
            self._owner_lock = None
