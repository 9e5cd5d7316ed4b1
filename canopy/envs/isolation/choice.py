"""The runtime a config names, `auto` resolved: `bwrap` when `image_root` is set, else `docker` when its daemon
answers, else `podman`."""

import shutil
import subprocess
from pathlib import Path

from canopy.envs.isolation.base import RuntimeSettings, RuntimeUnavailable
from canopy.envs.isolation.bubblewrap import BwrapRuntime
from canopy.envs.isolation.containers import ContainerRuntime


def resolve_kind(settings: RuntimeSettings) -> str:
    """The runtime `auto` stands for on this machine (see the module docstring)."""
    if settings.kind != "auto":
        return settings.kind
    if settings.image_root is not None:
        return "bwrap"
    for executable in ("docker", "podman"):
        if shutil.which(executable):
            try:
                ContainerRuntime.check(settings, executable)
                return executable
            except (RuntimeUnavailable, subprocess.TimeoutExpired):
                continue
    raise RuntimeUnavailable(
        "env.swebench.runtime.kind=auto found no runtime: set env.swebench.runtime.image_root to unpacked images "
        "(bwrap), or start a docker / podman daemon"
    )


def check_runtime(settings: RuntimeSettings) -> str:
    """Raise `RuntimeUnavailable` with the fix unless this machine can run the runtime; returns its kind."""
    kind = resolve_kind(settings)
    if kind == "bwrap":
        BwrapRuntime.check(settings)
    else:
        ContainerRuntime.check(settings, kind)
    return kind


def build_runtime(settings: RuntimeSettings, scratch: str | Path | None = None):
    kind = resolve_kind(settings)
    return BwrapRuntime(settings, scratch) if kind == "bwrap" else ContainerRuntime(settings, kind)
