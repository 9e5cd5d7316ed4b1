"""Serving-layer faults injected from inside an environment worker, for the fault soak (`canopy.tools.fault_soak`).

A task whose spec carries {"inject": kind, "phase": start | step | verdict} makes its worker fail that way at
that point: killed by SIGKILL (as by kill -9 or the OOM killer), stopped (it hangs), its environment code past
the worker's memory cap, aborted (it crashes), its episode's state overwritten by another episode's, a bug
raising in the environment, or its scratch filesystem filled by another tenant. Each must be quarantined.

`{"scratch_mb": N}` (and `scratch_full`, at 8 MiB when unset) puts the episode's folder on a tmpfs of its own, N MiB,
mounted in the worker's own mount namespace (root only): a filesystem that can be filled for real without filling the
machine's, and that goes with the worker. The agent's own faults are not injected here: the soak's
scripted agent sends them as code. This module imports no torch, so replacement workers start fast.
"""

import os
import signal

from canopy.envs.base import Task
from canopy.envs.python_tasks import PythonTaskEnvironment, PythonTaskEpisode
from canopy.envs.sandbox import prepare_scratch
from canopy.envs.sandbox_runner import _mount, private_mount_namespace

INFRA_FAULTS = ("kill9", "hang", "worker_oom", "worker_crash", "corruption", "environment_bug", "scratch_full")
NEEDS_ROOT = ("scratch_full",)  # mounts a filesystem
EPISODE_PHASES = ("corruption", "scratch_full")  # faults of a live episode: injected at step or verdict only


class FaultInjectingEnvironment(PythonTaskEnvironment):
    """Python tasks whose spec may carry an injected serving-layer fault; prompts carry the episode's task id."""

    name = "fault_injection"

    def start(self, task: Task, seed: int) -> "InjectedEpisode":
        if task.spec.get("phase") == "start":
            inject(task.spec["inject"], None)
        return InjectedEpisode(task, self.scratch_root, self.limits, self.max_observation_chars)


class InjectedEpisode(PythonTaskEpisode):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        size = self.task.spec.get("scratch_mb") or (8 if self.task.spec.get("inject") == "scratch_full" else None)
        if size is not None:
            self.on_tmpfs(size)

    def on_tmpfs(self, size_mb: int) -> None:
        """Move this episode's folder onto a tmpfs of `size_mb` MiB of its own (see the module docstring)."""
        private_mount_namespace()  # the worker's own: the tmpfs goes with it
        _mount("tmpfs", str(self.home), "tmpfs", 0, f"size={size_mb}m,mode=0711")
        (self.home / "identity").write_text(self.identity)
        prepare_scratch(self.scratch).chmod(0o700)

    def messages(self) -> list[dict]:
        system, user = super().messages()
        return [system, {**user, "content": f"{user['content']} [episode {self.task.task_id}]"}]

    def step(self, action_text: str):
        if self.task.spec.get("phase") == "step":
            inject(self.task.spec["inject"], self)
        return super().step(action_text)

    def verdict(self):
        if self.task.spec.get("phase") == "verdict":
            inject(self.task.spec["inject"], self)
        return super().verdict()


def inject(kind: str, episode: InjectedEpisode | None) -> None:
    """Make this worker fail the way `kind` names."""
    if kind == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "worker_oom":
        leak = bytearray(64 * 2**30)  # past the worker's address-space cap: MemoryError in the environment's code
        del leak
    elif kind == "worker_crash":
        os.abort()
    elif kind == "corruption" and episode is not None:
        (episode.home / "identity").write_text("another-episode")
    elif kind == "environment_bug":
        raise RuntimeError("injected bug in the environment")
    elif kind == "scratch_full" and episode is not None:
        fill(episode.home / "tenant.bin")
    else:
        raise ValueError(f"unknown fault {kind!r}: use one of {INFRA_FAULTS} ({EPISODE_PHASES} at step or verdict)")


def fill(path) -> None:
    """Write `path` until its filesystem has no room left: another tenant's file, outside the policy's folders."""
    with open(path, "ab", buffering=0) as tenant:
        try:
            while True:
                tenant.write(b"\0" * (64 << 10))
        except OSError:
            pass
        try:
            while True:
                tenant.write(b"\0" * 512)
        except OSError:
            pass
