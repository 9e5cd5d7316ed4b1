"""Whose fault an ending was (Appendix G): the evidence the serving layer needs before it quarantines an episode.

Quarantine removes a sample from its group before Eq. 3. If the policy could make its own failure look like the
serving layer's, it would learn to fail that way whenever it is about to fail, and never be pushed down (Appendix
G's optimistic bias). So the rule is: an ending is the agent's unless there is evidence from outside the agent's
reach that the serving layer caused it. `QUARANTINE_EVIDENCE` names, for every quarantine reason, that evidence and
why the policy cannot produce it; docs/environments.md shows it as a table (`evidence_table`).

`full_scratch` is the one probe every code-executing environment shares: a scratch filesystem filled by another
tenant makes a correct answer fail to be written, which is the serving layer's fault, while a policy that fills it
itself has only itself to blame. What the policy wrote is measured over the folders its code can write, in this
process's scratch root and, in a pool worker, in every worker's of the pool (the same policy's concurrent episodes).
"""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from canopy.envs.base import EnvironmentFault

POOL_SCRATCH = "CANOPY_POOL_SCRATCH"  # set by the pool for its workers: the folder holding every worker's scratch
FULL_BYTES = 4 << 20  # a filesystem with less free space than this (or FULL_INODES) is full: writes may fail
FULL_INODES = 64
OWN_SHARE = 0.1  # the policy's folders holding more than this share of the filesystem: its own doing

QUARANTINE_EVIDENCE = {  # reason -> (the evidence, why it is out of the policy's reach)
    "worker_killed": (
        "the worker process died of SIGKILL",
        "the policy's code cannot signal its worker: python_tasks runs it as another uid under Landlock's signal "
        "scope, SWE-bench inside bubblewrap's PID namespace, AppWorld's server under Landlock's signal scope and a "
        "seccomp filter; so the kill came from outside (kill -9, the kernel's OOM killer, a preemption)",
    ),
    "worker_crashed": ("the worker process exited or died of a signal", "as worker_killed: no signal reaches it"),
    "worker_unresponsive": (
        "a request outlived its timeout, which exceeds every limit put on the policy's code",
        "the worker waits for the policy's code at most its wall-time limit and kills it: only the worker's own "
        "hang outlives the request timeout (validate refuses timeouts that do not exceed those limits)",
    ),
    "worker_oom": (
        "MemoryError in the environment's own code, in the worker",
        "the policy's code runs in another process (sandbox, server) with a memory limit of its own",
    ),
    "worker_start_failed": ("a replacement worker did not start", "no policy code has run in it"),
    "environment_error": (
        "the environment's own code raised (a traceback in the worker)",
        "the environments read what the policy left defensively: every error opening or reading an answer is no "
        "answer, an unloadable end state scores 0, so a raise is a bug of the environment",
    ),
    "cross_episode_corruption": (
        "the worker answered for another episode, or the episode's identity file or live world is another's",
        "the identity file lies outside what the policy's code may write (Landlock), and the episode ids are the "
        "pool's",
    ),
    "sandbox_setup_failed": (
        "the sandbox runner exited with its setup status before reporting itself confined",
        "the runner reports on a private pipe once confined; the code's own exit(70) comes after that report",
    ),
    "sandbox_cleanup_failed": ("processes of the sandbox uid survive SIGKILL (zombies nobody reaps)", "kernel state"),
    "scratch_full": (
        "the scratch filesystem is full (statvfs) while the folders the policy's code can write hold a small share "
        f"of it (<= {OWN_SHARE:.0%})",
        "the policy writes only in its own folders (Landlock, bubblewrap), which are measured",
    ),
    "node_lost": ("Ray reports the node dead or unreachable", "the Ray cluster's own health state"),
    "injected_fault": ("env.fault_rate injects it (the vault world's Appendix G check)", "the configuration"),
    "image_missing": ("the task's image is not on this machine", "no policy code has run"),
    "wrong_base_commit": ("the fresh sandbox's HEAD is not base_commit", "checked before the first action"),
    "sandbox_failed": (
        "the runtime could not start a sandbox or run a command in it (no exit status from bubblewrap, a daemon error)",
        "reported by the runtime outside the sandbox, not by anything the command prints",
    ),
    "grading_sandbox_failed": ("as sandbox_failed, for the grading sandbox or the tamper guard's commands", "idem"),
    "grading_infra_failure": (
        "one of swebench's environment-tier signatures in the eval log outside the test output, found again when the "
        "task's gold patch is graded in a fresh sandbox right after",
        "every line of an eval log can be written by the patch (its code, an atexit hook, a daemon, a file name git "
        "prints), so a signature alone is the patch's; the gold patch's grading is out of the patch's reach",
    ),
    "appworld_server_start_failed": ("the server did not become healthy", "no policy code has run in it"),
    "appworld_server_killed": (
        "the AppWorld server died of SIGKILL",
        "its code cannot send SIGKILL (seccomp) nor signal any process but itself, and its memory is capped by the "
        "worker's address-space limit (an allocation past it is a MemoryError in the policy's code): the kill came "
        "from outside (kill -9, the kernel's OOM killer under another tenant's memory)",
    ),
    "appworld_server_died": (
        "the AppWorld server was found dead by a request that runs no policy code (start, close)",
        "a death during or after the policy's code is the agent's (agent_killed_server) unless by SIGKILL",
    ),
    "appworld_request_failed": (
        "a request that runs no policy code (/initialize, /close) failed",
        "a failure of /execute or of the /task_completed after it is the agent's (agent_broke_world)",
    ),
    "appworld_server_unresponsive": (
        "a request that runs no policy code outlived request_timeout_s",
        "a hang in /execute or the /task_completed after it is the agent's (agent_timeout)",
    ),
    "appworld_grader_failed": (
        "the grader process gave no verdict",
        "the grader runs no policy code, reads a copy of the end state capped in size, and scores an end state it "
        "cannot load 0",
    ),
}


def evidence_table() -> str:
    """QUARANTINE_EVIDENCE as the markdown table docs/environments.md shows."""
    rows = ["| reason | evidence | why the policy cannot produce it |", "|---|---|---|"]
    rows += [f"| `{reason}` | {what} | {why} |" for reason, (what, why) in QUARANTINE_EVIDENCE.items()]
    return "\n".join(rows) + "\n"


def scratch_root(default: str) -> Path:
    """This process's scratch root: its pool worker's (`CANOPY_SCRATCH_ROOT`), else `<tmp>/<default>`."""
    return Path(os.environ.get("CANOPY_SCRATCH_ROOT") or Path(tempfile.gettempdir()) / default)


def policy_folders(own_root: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The folders the policy's code can write: `patterns` below `own_root` and, in a pool worker, below every
    worker's scratch root of the pool (`POOL_SCRATCH`)."""
    pool = os.environ.get(POOL_SCRATCH)
    roots = [root for root in Path(pool).iterdir() if root.is_dir()] if pool else []
    roots = roots if own_root in roots else [own_root, *roots]
    return sorted({folder for root in roots for pattern in patterns for folder in root.glob(pattern)})


def usage(folders: list[Path], device: int) -> tuple[int, int]:
    """(bytes, inodes) the files and folders below `folders` hold on `device`, each inode counted once."""
    seen: set[int] = set()
    total, pending = 0, [str(folder) for folder in folders]
    while pending:  # a stack, not recursion: the policy can nest folders past any recursion limit
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_dev == device and info.st_ino not in seen:
                seen.add(info.st_ino)
                total += info.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
    return total, len(seen)


def full_scratch(path: Path, writable: Callable[[], list[Path]]) -> str | None:
    """The evidence that the filesystem holding `path` is full through no doing of the policy, whose code can write
    only the folders `writable()` lists (asked only when it is full); None when it has room, or when those folders
    hold more than OWN_SHARE of it (the policy's own doing: its episode is judged as it stands)."""
    try:
        fs, device = os.statvfs(path), os.stat(path).st_dev
    except OSError:
        return None
    free, size = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    inodes_full = fs.f_files > 0 and fs.f_favail < FULL_INODES
    if free >= FULL_BYTES and not inodes_full:
        return None
    folders = writable()
    own, own_inodes = usage(folders, device)
    if own > OWN_SHARE * size or (fs.f_files > 0 and own_inodes > OWN_SHARE * fs.f_files):
        return None
    return (
        f"the filesystem of {path} is full ({free} of {size} bytes, {fs.f_favail} of {fs.f_files} inodes free) "
        f"while the policy's {len(folders)} folders on it hold {own} bytes in {own_inodes} inodes: another tenant "
        "filled it"
    )


def scratch_fault(path: Path, writable: Callable[[], list[Path]]) -> EnvironmentFault | None:
    """`full_scratch`'s evidence as the fault that quarantines the episode, or None."""
    evidence = full_scratch(path, writable)
    return None if evidence is None else EnvironmentFault("scratch_full", evidence)
