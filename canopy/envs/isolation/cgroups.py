"""A cgroup per bwrap sandbox (v1 or v2; root), named by the pool's worker slot so a dead worker's cgroups are
removed with it."""

import os
import time
from pathlib import Path

from canopy.envs.isolation.base import RuntimeSettings, SandboxError, sigkill

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_V1_CONTROLLERS = ("memory", "pids", "cpu")


class Cgroup:
    """One sandbox's cgroup (v1: memory, pids and cpu hierarchies; v2: the unified one), under `canopy/`."""

    def __init__(self, name: str, settings: RuntimeSettings):
        v1 = _cgroup_v1()
        if v1:
            self.paths = [CGROUP_ROOT / c / "canopy" / name for c in CGROUP_V1_CONTROLLERS]
        else:
            _enable_v2_controllers()
            self.paths = [CGROUP_ROOT / "canopy" / name]
        for path in self.paths:
            path.mkdir(parents=True, exist_ok=True)
        memory, period = settings.memory_mb << 20, 100_000
        if v1:
            memory_dir, pids_dir, cpu_dir = self.paths
            (memory_dir / "memory.limit_in_bytes").write_text(str(memory))
            swap = memory_dir / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(memory))
            (pids_dir / "pids.max").write_text(str(settings.pids))
            (cpu_dir / "cpu.cfs_period_us").write_text(str(period))
            (cpu_dir / "cpu.cfs_quota_us").write_text(str(int(settings.cpus * period)))
        else:
            (path,) = self.paths
            (path / "memory.max").write_text(str(memory))
            (path / "pids.max").write_text(str(settings.pids))
            (path / "cpu.max").write_text(f"{int(settings.cpus * period)} {period}")

    def enter(self) -> None:
        """Move the calling process in (run in the command's child before it execs)."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        for path in self.paths:
            remove_cgroup(path)


def _cgroup_v1() -> bool:
    return (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists()


def _enable_v2_controllers() -> None:
    root = CGROUP_ROOT / "canopy"
    root.mkdir(exist_ok=True)
    for folder in (CGROUP_ROOT, root):
        (folder / "cgroup.subtree_control").write_text("+memory +pids +cpu")


def cgroups_usable() -> bool:
    """Root with a writable cgroup hierarchy (v1 or v2)."""
    if os.geteuid() != 0:
        return False
    probe = CGROUP_ROOT / ("pids" if _cgroup_v1() else "") / "canopy"
    try:
        probe.mkdir(parents=True, exist_ok=True)
        return os.access(probe, os.W_OK)
    except OSError:
        return False


def cgroup_members(path: Path) -> list[int]:
    """The pids in a cgroup (none once it is gone)."""
    procs = path / "cgroup.procs"
    return [int(pid) for pid in procs.read_text().split()] if procs.exists() else []


def remove_cgroup(path: Path) -> None:
    """Kill everything in the cgroup (and below), then remove it."""
    if not path.is_dir():
        return
    for child in [p for p in path.iterdir() if p.is_dir()]:
        remove_cgroup(child)
    deadline = time.monotonic() + 10
    while True:
        pids = cgroup_members(path)
        sigkill(pids)
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SandboxError(f"cgroup {path} still holds processes {pids} after SIGKILL") from None
            time.sleep(0.01)
