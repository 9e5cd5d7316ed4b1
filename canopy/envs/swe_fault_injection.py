"""SWE-bench serving faults injected from inside an environment worker, with per-operation latencies, for the fault
soak's SWE mode (`canopy.tools.fault_soak.swe_soak`).

A task whose spec carries {"inject": kind, "phase": start | step | verdict} fails that way at that point, and must
be quarantined with the reason `SERVING_FAULTS` gives: the worker killed by SIGKILL, stopped, past its memory cap,
aborted or raising (as `canopy.envs.fault_injection` does); the image missing; the sandbox's HEAD moved off
base_commit; a sandbox that fails to start or to run a command; the grading sandbox failing to start; an eval log
with a swebench infrastructure signature. The faults are injected around `SWEBenchEnvironment` (a wrapped runtime),
never inside it. Every sandbox start, command and grading appends its seconds to `<latency_dir>/<pid>.jsonl`.
"""

import json
import os
import time
from dataclasses import replace
from pathlib import Path

from canopy.envs.base import Task
from canopy.envs.fault_injection import inject
from canopy.envs.isolation import ImageMissing, SandboxError
from canopy.envs.swe_grading import EVAL_PATH
from canopy.envs.swebench import SWEBenchEnvironment, SWEBenchEpisode

WORKER_FAULTS = ("kill9", "hang", "worker_oom", "worker_crash", "environment_bug")  # canopy.envs.fault_injection's
SERVING_FAULTS = {  # kind -> (the phases it is injected at, the reason it must be quarantined for)
    "kill9": (("start", "step", "verdict"), "worker_killed"),
    "hang": (("start", "step", "verdict"), "worker_unresponsive"),
    "worker_oom": (("start", "step", "verdict"), "worker_oom"),
    "worker_crash": (("start", "step", "verdict"), "worker_crashed"),
    "environment_bug": (("start", "step", "verdict"), "environment_error"),
    "image_missing": (("start",), "image_missing"),
    "wrong_base_commit": (("start",), "wrong_base_commit"),
    "sandbox_failed": (("start", "step"), "sandbox_failed"),
    "grading_sandbox_failed": (("verdict",), "grading_sandbox_failed"),
    "grading_infra_failure": (("verdict",), "grading_infra_failure"),
}
INFRA_SIGNATURE = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
DRIFT = "git -c user.name=drift -c user.email=drift@localhost commit -q --allow-empty -m drift"


class InjectingRuntime:
    """A runtime that times its sandboxes and fails the way its `armed` fault says (set per episode phase)."""

    def __init__(self, runtime, latency_dir: str | None):
        self.runtime, self.armed, self.grading = runtime, None, False
        self.log = None
        if latency_dir is not None:
            Path(latency_dir).mkdir(parents=True, exist_ok=True)
            self.log = open(Path(latency_dir) / f"{os.getpid()}.jsonl", "a", buffering=1)

    @property
    def measures_writes(self) -> bool:
        return self.runtime.measures_writes

    @property
    def scratch(self):
        return self.runtime.scratch

    def writable_folders(self):
        return self.runtime.writable_folders()

    def record(self, op: str, seconds: float) -> None:
        if self.log is not None:
            self.log.write(json.dumps({"op": op, "s": round(seconds, 6)}) + "\n")

    def start(self, image: str) -> "InjectingSandbox":
        if self.armed == "image_missing":
            raise ImageMissing(f"image {image}: injected as missing")
        if self.armed in ("sandbox_failed", "grading_sandbox_failed"):
            raise SandboxError(f"injected: a sandbox of {image} failed to start")
        started = time.monotonic()
        sandbox = InjectingSandbox(self.runtime.start(image), self, "grading_command" if self.grading else "command")
        self.record("sandbox_start", time.monotonic() - started)
        if self.armed == "wrong_base_commit":
            sandbox.sandbox.run(DRIFT, 60)
        return sandbox


class InjectingSandbox:
    def __init__(self, sandbox, runtime: InjectingRuntime, op: str):
        self.sandbox, self.runtime, self.op = sandbox, runtime, op

    def run(self, command: str, timeout: float, stdin: bytes | None = None, env: dict | None = None):
        if self.runtime.armed == "sandbox_failed":
            raise SandboxError("injected: the sandbox could not run a command")
        started = time.monotonic()
        result = self.sandbox.run(command, timeout, stdin=stdin, env=env)
        self.runtime.record(self.op, time.monotonic() - started)
        if self.runtime.armed == "grading_infra_failure" and command == f"/bin/bash {EVAL_PATH}":
            result = replace(result, output=f"{result.output}\n{INFRA_SIGNATURE}\n")
        return result

    def close(self) -> None:
        self.sandbox.close()


class FaultInjectingSWEEnvironment(SWEBenchEnvironment):
    """SWE-bench whose tasks' spec may carry an injected serving fault; prompts carry the episode's task id."""

    name = "swe_fault_injection"

    def __init__(self, latency_dir: str | None = None, **settings):
        super().__init__(**settings)
        self.runtime = InjectingRuntime(self.runtime, latency_dir)

    def start(self, task: Task, seed: int) -> "InjectedSWEEpisode":
        self.runtime.armed = None
        arm(self, task, "start")
        return InjectedSWEEpisode(self, task)


class InjectedSWEEpisode(SWEBenchEpisode):
    def messages(self) -> list[dict]:
        system, user = super().messages()
        return [system, {**user, "content": f"{user['content']} [episode {self.task.task_id}]"}]

    def step(self, action_text: str):
        arm(self.env, self.task, "step")
        return super().step(action_text)

    def verdict(self):
        arm(self.env, self.task, "verdict")
        graded = bool(self.submission and self.submission.strip()) and not self.image_unavailable
        self.env.runtime.grading = True
        started = time.monotonic()
        try:
            verdict = super().verdict()
        finally:
            self.env.runtime.grading = False
        if graded:
            self.env.runtime.record("grading", time.monotonic() - started)
        return verdict


def arm(env: FaultInjectingSWEEnvironment, task: Task, phase: str) -> None:
    """Inject the task's fault if it is due at `phase`: a worker fault now, a runtime fault from now on."""
    if task.spec.get("phase") != phase:
        return
    kind = task.spec["inject"]
    if kind in WORKER_FAULTS:
        inject(kind, None)
    elif kind in SERVING_FAULTS:
        env.runtime.armed = kind
    else:
        raise ValueError(f"unknown fault {kind!r}: use one of {tuple(SERVING_FAULTS)}")
