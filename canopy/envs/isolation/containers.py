"""`docker` / `podman`: a container per sandbox (`--network none --cpus --memory --pids-limit`), commands by `exec`,
labelled with the worker slot so a dead worker's containers are removed with it."""

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from canopy.envs.isolation.base import (
    SLOT_TAG,
    CommandResult,
    ImageMissing,
    RuntimeSettings,
    RuntimeUnavailable,
    SandboxError,
    read_output,
    sigkill,
)

LABEL = "canopy.slot"
CONTAINER_MARKER = "container-runtime"  # in a worker's scratch folder: the docker or podman its sandboxes use
PODMAN_FLAGS = ("--runtime", "runc", "--cgroup-manager", "cgroupfs")  # crun fails on hybrid cgroups (design notes)


class ContainerRuntime:
    """docker or podman: one container per sandbox, commands by `exec` (see the module docstring)."""

    measures_writes = False  # a container's writable layer lives in the daemon's storage: a full disk there is not
    # told apart from the policy's own writes (the command fails; the episode is judged as it stands)

    def __init__(self, settings: RuntimeSettings, executable: str):
        self.settings, self.executable, self.name = settings, executable, executable
        self.prefix = [executable, *(PODMAN_FLAGS if executable == "podman" else ())]
        if os.environ.get("CANOPY_SCRATCH_ROOT"):  # a pool worker: tell `release_slot` whose containers to remove
            scratch = Path(os.environ["CANOPY_SCRATCH_ROOT"])
            scratch.mkdir(parents=True, exist_ok=True)
            (scratch / CONTAINER_MARKER).write_text(executable)

    @staticmethod
    def check(settings: RuntimeSettings, executable: str) -> None:
        if shutil.which(executable) is None:
            raise RuntimeUnavailable(f"{executable} is not installed: apt-get install {executable}, or use bwrap")
        probe = subprocess.run([executable, "info"], capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            raise RuntimeUnavailable(
                f"{executable} does not answer ({(probe.stderr.strip().splitlines() or ['?'])[-1]}): start its daemon "
                "without a network bridge (docs/environments.md, SWE-bench), or use env.swebench.runtime.kind=bwrap"
            )

    def has_image(self, image: str) -> bool:
        return subprocess.run([*self.prefix, "image", "inspect", image], capture_output=True).returncode == 0

    def start(self, image: str) -> "ContainerSandbox":
        if not self.has_image(image):
            raise ImageMissing(f"image {image} is not in the {self.executable} store")
        s = self.settings
        limits = [
            "--network",
            "none",
            "--cpus",
            str(s.cpus),
            "--memory",
            f"{s.memory_mb}m",
            "--pids-limit",
            str(s.pids),
        ]
        if self.executable == "podman":  # explicit rlimits, within this process's own (it cannot raise them)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            limits += ["--ulimit", f"nproc={s.pids}:{s.pids}", "--ulimit", f"nofile={soft}:{hard}"]
        tag = os.environ.get(SLOT_TAG, "canopy")
        run = [
            *self.prefix,
            "run",
            "-d",
            "--pull",
            "never",
            "--init",
            "--label",
            f"{LABEL}={tag}",
            *limits,
            "-w",
            s.workdir,
        ]
        started = subprocess.run(
            [*run, "--entrypoint", "sleep", image, "infinity"], capture_output=True, text=True, timeout=300
        )
        if started.returncode != 0:
            raise SandboxError(f"{self.executable} run {image}: {started.stderr.strip()[-300:]}")
        return ContainerSandbox(self, started.stdout.strip())


class ContainerSandbox:
    """A container (its init reaps) in which every process but the init and its `sleep` is killed after each
    command: as under bwrap, nothing a command starts outlives it, and a backgrounded fork bomb cannot exhaust the
    pids limit of the commands after it."""

    def __init__(self, runtime: ContainerRuntime, container: str):
        self.runtime, self.container = runtime, container
        self.keep = set(self._host_pids())

    def _host_pids(self) -> list[int]:
        host_pid = ["hpid"] if self.runtime.executable == "podman" else ["-eo", "pid"]  # host pids, not the container's
        listing = subprocess.run(
            [*self.runtime.prefix, "top", self.container, *host_pid], capture_output=True, text=True
        )
        return [int(pid) for pid in listing.stdout.split()[1:] if pid.isdigit()]

    def _kill_leftovers(self) -> None:
        sigkill(set(self._host_pids()) - self.keep)

    def run(self, command: str, timeout: float, stdin: bytes | None = None, env: dict | None = None) -> CommandResult:
        exec_args = [*self.runtime.prefix, "exec", "-i", "-w", self.runtime.settings.workdir]
        for key, value in (env or {}).items():
            exec_args += ["-e", f"{key}={value}"]
        # the container's own `timeout` kills the command inside; the client's deadline is only a backstop
        inner = ["timeout", "-s", "KILL", str(int(timeout)), "bash", "-lc", command]
        started = time.monotonic()
        with tempfile.TemporaryFile() as output:
            try:
                process = subprocess.run(
                    [*exec_args, self.container, *inner],
                    input=stdin or b"",
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    timeout=timeout + 30,
                )
            except subprocess.TimeoutExpired:
                raise SandboxError(
                    f"{self.runtime.executable} exec did not return within {timeout + 30:.0f} s"
                ) from None
            text = read_output(output, self.runtime.settings.max_output_bytes)
        self._kill_leftovers()
        if process.returncode in (125, 126) and "Error response from daemon" in text:
            raise SandboxError(text.strip()[-300:])
        timed_out = process.returncode == 128 + signal.SIGKILL and time.monotonic() - started >= timeout
        return CommandResult(text, process.returncode, timed_out)

    def close(self) -> None:
        subprocess.run([*self.runtime.prefix, "rm", "-f", self.container], capture_output=True)
