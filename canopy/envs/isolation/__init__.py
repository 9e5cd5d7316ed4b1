"""Sandbox runtimes for repository tasks (SWE-bench, Appendix H): one protocol, three back ends, and `auto`.

A `Runtime` starts a `Sandbox` from an image; a sandbox runs shell commands in the task's working directory
(`/testbed`), each in a fresh `bash -lc` subshell as mini-swe-agent's environments do, with no network and the
episode's limits (Table A3: 2 CPU, 6 GB; a process cap). Files written by one command are seen by the next;
processes do not outlive their command.

- `base`: the settings, a command's result, the errors, the worker slot's tag.
- `bubblewrap` (`bwrap`), on per-sandbox overlays, limited by `cgroups`; `containers` (`docker`, `podman`).
- `choice`: the runtime a config names, `auto` resolved; `slots`: a stopped worker slot's sandboxes removed.
"""

from canopy.envs.isolation.base import (
    SLOT_TAG,
    ImageMissing,
    RuntimeSettings,
    RuntimeUnavailable,
    SandboxError,
    safe_image_name,
)
from canopy.envs.isolation.choice import build_runtime, check_runtime
from canopy.envs.isolation.slots import release_slot

__all__ = [
    "SLOT_TAG",
    "ImageMissing",
    "RuntimeSettings",
    "RuntimeUnavailable",
    "SandboxError",
    "build_runtime",
    "check_runtime",
    "release_slot",
    "safe_image_name",
]
