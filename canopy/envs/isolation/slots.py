"""What a worker slot's sandboxes leave behind, removed when the pool stops the worker."""

import subprocess
from pathlib import Path

from canopy.envs.isolation.base import SandboxError
from canopy.envs.isolation.cgroups import CGROUP_ROOT, CGROUP_V1_CONTROLLERS, remove_cgroup
from canopy.envs.isolation.containers import CONTAINER_MARKER, LABEL, PODMAN_FLAGS


def release_slot(tag: str, scratch: Path) -> None:
    """Remove everything a worker slot's sandboxes left: cgroups, and the containers of the docker or podman its
    runtime named in `scratch` (the worker's scratch folder). Called by the pool when it stops a worker (which may
    have been killed mid-episode)."""
    for root in [CGROUP_ROOT / c / "canopy" for c in CGROUP_V1_CONTROLLERS] + [CGROUP_ROOT / "canopy"]:
        if root.is_dir():
            for path in root.glob(f"{tag}-*"):
                remove_cgroup(path)
    marker = scratch / CONTAINER_MARKER
    if not marker.is_file():
        return
    executable = marker.read_text().strip()
    command = [executable, *(PODMAN_FLAGS if executable == "podman" else ())]
    try:
        listing = subprocess.run(
            [*command, "ps", "-aq", "--filter", f"label={LABEL}={tag}"], capture_output=True, text=True, timeout=60
        )
        if listing.returncode == 0 and listing.stdout.split():
            subprocess.run([*command, "rm", "-f", *listing.stdout.split()], capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{executable} did not answer while removing the containers of {tag}") from None
