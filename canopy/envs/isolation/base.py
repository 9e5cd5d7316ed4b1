"""What every sandbox runtime shares: its settings, a command's result, the errors, the worker slot's tag.

`RuntimeUnavailable` (the machine cannot run this runtime) is a setup error with its fix; `SandboxError` (one
sandbox failed to start or to run a command) and `ImageMissing` are the serving layer's faults.
"""

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from canopy.errors import require

SLOT_TAG = "CANOPY_SANDBOX_TAG"  # set by the pool per worker slot: names the slot's cgroups and containers


class RuntimeUnavailable(RuntimeError):
    """This machine cannot run the runtime; the message names the fix."""


class SandboxError(RuntimeError):
    """A sandbox could not be started, or could not run a command: the serving layer's fault."""


class ImageMissing(SandboxError):
    """The task's image is not on this machine (the image-cache step of `canopy.tools.swe_data` puts it there)."""


@dataclass(frozen=True)
class RuntimeSettings:
    """`env.swebench.runtime.*`: the schema and the only defaults of those keys (Table A3: 2 CPU, 6 GB per episode)."""

    kind: str = "auto"  # auto | bwrap | docker | podman (`choice.resolve_kind` says what auto picks)
    image_root: str | None = None  # bwrap: unpacked images, <image_root>/<safe name>/rootfs
    cpus: float = 2.0
    memory_mb: int = 6144  # a cgroup caps each sandbox's memory at this
    pids: int = 1024
    workdir: str = "/testbed"
    max_output_bytes: int = 1_000_000  # per command; the head and tail halves are kept past it

    def validate(self) -> None:

        prefix = "env.swebench.runtime"
        require(
            self.kind in ("auto", "bwrap", "docker", "podman"),
            f"{prefix}.kind={self.kind!r} is unknown: use auto, bwrap, docker or podman",
        )
        for key in ("cpus", "memory_mb", "pids", "max_output_bytes"):
            require(getattr(self, key) > 0, f"{prefix}.{key}={getattr(self, key)} must be > 0")
        require(
            self.kind != "bwrap" or self.image_root is not None,
            f"{prefix}.kind=bwrap needs {prefix}.image_root: the folder of unpacked images",
        )


@dataclass(frozen=True)
class CommandResult:
    output: str  # stdout and stderr interleaved
    returncode: int
    timed_out: bool = False


def safe_image_name(image: str) -> str:
    """The folder name of an image under `image_root`."""
    return image.replace("/", "_").replace(":", "_")


def read_output(file, cap: int) -> str:
    """A command's output file as text; past `cap` bytes, its first and last `cap / 2` with a note between."""
    size = file.seek(0, os.SEEK_END)
    file.seek(0)
    if size <= cap:
        return file.read().decode("utf-8", errors="replace")
    head = file.read(cap // 2)
    file.seek(size - cap // 2)
    note = f"\n[canopy: {size - cap} bytes elided]\n".encode()
    return (head + note + file.read()).decode("utf-8", errors="replace")


def sigkill(pids) -> None:
    """SIGKILL each pid; one already gone, or not this process's to signal, is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def remove_tree(path: str | Path) -> None:
    """Remove `path` and everything below it, however deep, ignoring errors (as `shutil.rmtree(ignore_errors=True)`).
    The policy's code can nest folders deeper than Python 3.11's recursive `rmtree` goes, and its RecursionError
    escapes `ignore_errors`: a scratch folder that could not be removed failed every later pool's start. GNU `rm`
    walks any depth."""
    subprocess.run(["rm", "-rf", "--", str(path)], stdin=subprocess.DEVNULL, capture_output=True)
