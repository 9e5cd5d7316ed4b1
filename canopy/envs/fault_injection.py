"""Serving-layer faults injected from inside an environment worker, for the fault soak (`canopy.tools.fault_soak`).

A task whose spec carries {"inject": kind, "phase": start | step | verdict} makes its worker fail that way at
that point: killed by SIGKILL (as by kill -9 or the OOM killer), stopped (it hangs), its environment code past
the worker's memory cap, aborted (it crashes), its episode's state overwritten by another episode's, or a bug
raising in the environment. Each must be quarantined. The agent's own faults are not injected here: the soak's
scripted agent sends them as code. This module imports no torch, so replacement workers start fast.
"""

import os
import signal

from canopy.envs.base import Task
from canopy.envs.python_tasks import PythonTaskEnvironment, PythonTaskEpisode

INFRA_FAULTS = ("kill9", "hang", "worker_oom", "worker_crash", "corruption", "environment_bug")


class FaultInjectingEnvironment(PythonTaskEnvironment):
    """Python tasks whose spec may carry an injected serving-layer fault; prompts carry the episode's task id."""

    name = "fault_injection"

    def start(self, task: Task, seed: int) -> "InjectedEpisode":
        if task.spec.get("phase") == "start":
            inject(task.spec["inject"], None)
        return InjectedEpisode(task, self.scratch_root, self.limits, self.max_observation_chars)


class InjectedEpisode(PythonTaskEpisode):
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
    else:
        raise ValueError(f"unknown fault {kind!r}: use one of {INFRA_FAULTS} (corruption needs phase step or verdict)")
