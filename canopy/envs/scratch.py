"""A pool's scratch folder on the machine: its owner lock, its slots' tags, and the sweep of folders whose pool died.

`EnvironmentPool` claims its folder (`claim_scratch`) before its workers start and holds the lock while they run. A
pool killed before `close()` (kill -9, the OOM killer, a preempted job) leaves the lock free, and the next pool to
start on the machine removes the folder and what its slots' sandboxes left (`sweep_abandoned_scratch`).
"""

import fcntl
import os
import time
import warnings
from pathlib import Path

from canopy.envs.base import SystemicFaultError
from canopy.envs.isolation import SandboxError, release_slot
from canopy.envs.isolation.base import remove_tree

SCRATCH_PREFIX = "canopy-envs-"  # a pool's default scratch folder, in the temporary folder: canopy-envs-<pid>-<id>
OWNER_LOCK = ".owner"  # in a scratch folder: flock-ed by the pool that owns it, holding the owner's pid


def slot_tag(scratch: Path) -> str:
    """The name of a worker slot's sandboxes' cgroups and containers, from the slot's scratch folder
    (`<pool scratch>/w<slot>`): `<pool scratch folder's name>-w<slot>`, unique on the machine."""
    return f"{scratch.parent.name}-{scratch.name}"


def claim_scratch(root: Path) -> int:
    """Create the pool's scratch folder and take its owner lock (the fd returned). The kernel drops an flock when
    its process dies, kill -9 included, so a free lock marks an abandoned folder. The pid is written only while the
    lock is held: an empty lock file is a pool still starting, never swept."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)  # sandbox users must reach their own scratch directories below it
    fd = os.open(root / OWNER_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    deadline = time.monotonic() + 1.0  # a sweeper holds a free lock only while it reads the file
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                owner = (root / OWNER_LOCK).read_text().strip() or "?"
                raise SystemicFaultError(
                    f"scratch folder {root} belongs to a live pool (pid {owner}): give each pool its own"
                ) from None
            time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def sweep_abandoned_scratch(parent: Path) -> None:
    """Remove the scratch folders in `parent` whose pool died without `close()`, with what their slots'
    sandboxes left (`release_slot`: cgroups, containers). A folder whose owner lives, that is still starting, or
    that has no owner lock (not a pool's, or another user's) is left alone; one whose containers cannot be removed
    now is kept, with a warning, for a later sweep."""
    for root in parent.glob(f"{SCRATCH_PREFIX}*"):
        try:
            fd = os.open(root / OWNER_LOCK, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not os.read(fd, 64):
                continue
            for slot in root.glob("w*"):
                release_slot(slot_tag(slot), slot)
            remove_tree(root)
        except BlockingIOError:
            pass
        except SandboxError as error:
            warnings.warn(f"left the abandoned scratch folder {root} for a later run: {error}", stacklevel=2)
        finally:
            os.close(fd)
