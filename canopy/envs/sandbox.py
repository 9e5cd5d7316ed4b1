"""Sandboxed execution of the policy's code (Appendix G: the agent's own faults are the agent's).

`run_sandboxed(code, scratch, limits)` runs one action in a fresh Python process (see `sandbox_runner.py`)
with no network, no writes outside `scratch`, bounded CPU time, wall time, memory, file size and processes,
and kills everything it started when it returns. The outcome says whose fault an abnormal end was:
`timeout`, `memory`, `processes` and `crashed` are the agent's (its infinite loop, memory bomb, fork bomb,
or its own crash); `error` is an ordinary exception or syntax error, reported back as an observation;
a sandbox that could not be set up raises `EnvironmentFault` (the serving layer's fault).

When the caller is root, each sandbox runs as an unprivileged uid of its own, claimed with a lock file so no
other process of any Canopy run uses it (the pool claims one per worker and passes it as `CANOPY_SANDBOX_UID`):
the process limit then counts only that sandbox's processes, and every process it left behind is found and
killed by uid. Unprivileged callers get a user namespace instead, and a process limit of (their current process
count + `max_processes`).
"""

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from canopy.envs.base import EnvironmentFault
from canopy.envs.sandbox_runner import EXIT_MEMORY, EXIT_PROCESSES, EXIT_SETUP
from canopy.errors import require

RUNNER = Path(__file__).with_name("sandbox_runner.py")
FIRST_UID = 61000
PR_SET_CHILD_SUBREAPER = 36
# Machine-wide, as the uids are: not under $TMPDIR, which differs between the processes of one machine (Ray gives
# its nodes their own), so that two claimants would each see a free uid and kill each other's sandboxes.
UID_LOCKS = Path("/tmp/canopy-sandbox-uids")
_ONE_AT_A_TIME = threading.Lock()  # see `run_sandboxed`


@dataclass(frozen=True)
class SandboxLimits:
    """`env.sandbox.*`, the limits on the policy's code (code-executing environments): the schema and the only
    defaults of those keys."""

    cpu_seconds: int = 30
    wall_seconds: float = 60.0
    memory_mb: int = 2048
    max_processes: int = 32
    max_file_mb: int = 64
    max_output_chars: int = 8000

    def validate(self) -> None:
        """`env.sandbox.*`: one line naming the fix on the first bad value."""

        for key in ("cpu_seconds", "wall_seconds", "memory_mb", "max_processes", "max_file_mb", "max_output_chars"):
            require(getattr(self, key) > 0, f"env.sandbox.{key}={getattr(self, key)} must be > 0")


@dataclass(frozen=True)
class ExecResult:
    status: str  # ok | error | timeout | memory | processes | crashed
    output: str  # stdout and stderr interleaved, cut to max_output_chars
    returncode: int | None

    @property
    def agent_fault(self) -> bool:
        """True when the agent's code broke a limit or crashed its own process: the episode ends, scored 0."""
        return self.status in ("timeout", "memory", "processes", "crashed")


def sandbox_uid() -> int | None:
    """The uid this process's sandboxes run as: its worker's (CANOPY_SANDBOX_UID), else one it claims."""
    if os.geteuid() != 0:
        return None
    return int(os.environ.get("CANOPY_SANDBOX_UID") or _own_uid())


@functools.cache
def _own_uid() -> int:
    return claim_uid()[0]


def claim_uid() -> tuple[int, int]:
    """An unprivileged uid no other live process of any Canopy run holds, and the lock fd that holds it
    (released once every process holding a copy of `fd` has closed it or exited). Two runs on one machine therefore
    never kill each other's code. Whatever a dead holder's sandboxes left running as the uid is killed first: it
    would count against the new holder's process limit, and could signal the new holder's processes (a uid whose
    leftovers cannot be cleared is skipped)."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    for uid in range(FIRST_UID, FIRST_UID + 10_000):
        fd = os.open(UID_LOCKS / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            kill_uid(uid)
        except EnvironmentFault:  # zombies nobody reaps: take another uid
            os.close(fd)
            continue
        return uid, fd
    raise EnvironmentFault("sandbox_setup_failed", f"every sandbox uid from {FIRST_UID} is claimed: clear {UID_LOCKS}")


@functools.cache
def sandbox_python(uid: int | None) -> str:
    """An interpreter the sandbox user can run: ours if that user can read it, else the system's python3."""
    if uid is None:
        return sys.executable
    failures = []
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            probe = subprocess.run(
                [python, "-I", "-S", "-c", "import ctypes, json, traceback"],
                user=uid,
                group=uid,
                extra_groups=[],
                capture_output=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            failures.append(f"{python}: {error}")
            continue
        if probe.returncode == 0:
            return python
        failures.append(f"{python}: exit {probe.returncode} {probe.stderr.decode(errors='replace').strip()[-200:]}")
    raise EnvironmentFault(
        "sandbox_setup_failed",
        f"no Python is readable by sandbox uid {uid}: install python3 outside /root ({'; '.join(failures)})",
    )


@contextlib.contextmanager
def _subreaper():
    """While a sandbox runs and is cleaned up, orphans of its code are re-parented to this process instead of init,
    so that `kill_uid` can reap them. Afterwards this process is an ordinary parent again: a subreaper for good
    adopts the orphans of everything it starts later, and nothing reaps those (766 zombies once piled up under one
    test process)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _processes():
    return (entry for entry in os.scandir("/proc") if entry.name.isdigit())


def _owner(entry: os.DirEntry) -> int | None:
    try:
        return entry.stat().st_uid
    except FileNotFoundError:
        return None


def _zombie(entry: os.DirEntry) -> bool:
    try:
        with open(f"{entry.path}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _process_count(uid: int) -> int:
    return sum(_owner(entry) == uid for entry in _processes())


def prepare_scratch(scratch: Path) -> Path:
    """An empty directory the sandbox user owns: the only place its code may write."""
    scratch.mkdir(parents=True, exist_ok=True)
    uid = sandbox_uid()
    if uid is not None:
        closed = next((p for p in scratch.resolve().parents if not p.stat().st_mode & stat.S_IXOTH), None)
        if closed is not None:
            raise EnvironmentFault(
                "sandbox_setup_failed", f"{closed} is closed to the sandbox user: chmod o+x it or scratch elsewhere"
            )
        os.chown(scratch, uid, uid)
    return scratch


def private_home(home: Path) -> dict[str, str]:
    """Environment variables that send the per-user folders libraries create on first use into `home`: the
    home and XDG folders, and the variables that override them when a user has set them (IPython, matplotlib,
    Hugging Face, Triton, inductor, AppWorld). A confined process cannot write to the user's home (IPython's
    `~/.ipython` once failed every AppWorld episode of a fresh machine), and a run must not depend on it."""
    home.mkdir(parents=True, exist_ok=True)
    folders = {
        "HOME": "",
        "XDG_CACHE_HOME": ".cache",
        "XDG_CONFIG_HOME": ".config",
        "XDG_DATA_HOME": ".local/share",
        "XDG_STATE_HOME": ".local/state",
        "IPYTHONDIR": ".ipython",
        "MPLCONFIGDIR": ".config/matplotlib",
        "HF_HOME": ".cache/huggingface",
        "TRITON_CACHE_DIR": ".triton/cache",
        "TORCHINDUCTOR_CACHE_DIR": ".cache/torchinductor",
        "APPWORLD_CACHE": ".appworld",
    }
    return {variable: str(home / folder) for variable, folder in folders.items()}


def run_sandboxed(code: str, scratch: Path, limits: SandboxLimits) -> ExecResult:
    """Run `code` confined in `scratch`. The sandboxes of one process share its uid and end by killing every
    process of that uid, so they run one at a time: concurrent episodes of an in-process environment would
    otherwise kill (and reap) each other's code. A pool runs them in parallel, one uid per worker."""
    with _ONE_AT_A_TIME, _subreaper():
        return _run_sandboxed(code, scratch, limits)


def _run_sandboxed(code: str, scratch: Path, limits: SandboxLimits) -> ExecResult:
    uid = sandbox_uid()
    nproc = limits.max_processes if uid is not None else _process_count(os.getuid()) + limits.max_processes
    ready, ready_signal = os.pipe()  # the runner writes b"1" to `ready_signal` once confined, before the code runs
    settings = {**asdict(limits), "uid": uid, "nproc": nproc, "parent_pid": os.getpid(), "ready_fd": ready_signal}
    environment = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        **private_home(scratch),
        "TMPDIR": str(scratch),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    # output: a file, not a pipe: a flood of output cannot block or bloat us
    with tempfile.TemporaryFile() as output, open(ready, "rb", buffering=0) as confirmation:
        try:
            process = subprocess.Popen(
                [sandbox_python(uid), "-I", "-S", str(RUNNER), str(scratch), json.dumps(settings)],
                stdin=subprocess.PIPE,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=scratch,
                env=environment,
                start_new_session=True,
                pass_fds=(ready_signal,),
            )
        finally:
            os.close(ready_signal)
        try:
            process.stdin.write(code.encode())
            process.stdin.close()
        except BrokenPipeError:
            pass  # it died before reading its code; its exit status says why
        timed_out = not _wait_unreaped(process.pid, limits.wall_seconds)
        _kill_everything(process)
        returncode = process.returncode
        output.seek(0)
        text = output.read(limits.max_output_chars * 4).decode(errors="replace")[: limits.max_output_chars]
        os.set_blocking(ready, False)  # every writer is dead by now; this only guards against a hang
        set_up = (confirmation.read(1) or b"") == b"1"
    if returncode == EXIT_SETUP and not set_up:  # the code's own exit(70) is the code's, not a setup fault
        raise EnvironmentFault("sandbox_setup_failed", text.strip().splitlines()[-1] if text.strip() else "")
    return ExecResult(_status(returncode, timed_out), text, None if timed_out else returncode)


def confined(
    command: list[str], writable: list[str | Path], hidden: list[str | Path] = (), shown: list[str | Path] = ()
) -> list[str]:
    """`command` wrapped so that it runs with no network and no capabilities, writes only beneath `writable` (and
    /dev/null), sees each `hidden` path as an empty read-only folder (`writable` and `shown` paths beneath one stay
    as they are), and dies with this process: for servers that run the policy's code themselves (AppWorld's)."""
    paths = lambda paths: [str(path) for path in paths]  # noqa: E731
    view = json.dumps({"hidden": paths(hidden), "shown": paths(shown)})
    return [
        *(sys.executable, "-I", "-S", str(RUNNER), "--exec", json.dumps(paths(writable)), view, str(os.getpid())),
        *("--", *command),
    ]


def _status(returncode: int, timed_out: bool) -> str:
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode == EXIT_MEMORY:
        return "memory"
    if returncode == EXIT_PROCESSES:
        return "processes"
    if returncode < 0:
        return "crashed"
    return "ok" if returncode == 0 else "error"


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait for `pid` to exit without reaping it, so its process group id cannot be reused before we kill it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.005)
    return False


def _kill_everything(process: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group, reap it, then kill every process the sandbox uid still owns."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    uid = sandbox_uid()
    if uid is not None:
        kill_uid(uid)


def kill_uid(uid: int) -> None:
    """Kill every process owned by `uid`, a fork bomb's escaped children included, and wait until they are
    gone: zombies still count against the next sandbox's process limit. This process is a child subreaper
    (see `run_sandboxed`), so the orphans come back to it to be reaped."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        owned = [(int(entry.name), _zombie(entry)) for entry in _processes() if _owner(entry) == uid]
        if not owned:
            return
        for pid, zombie in owned:
            try:
                if zombie:
                    os.waitpid(pid, os.WNOHANG)
                else:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, ChildProcessError):
                pass  # gone already, or a zombie another process reaps
        time.sleep(0.001)
    raise EnvironmentFault("sandbox_cleanup_failed", f"processes of uid {uid} survive SIGKILL")
