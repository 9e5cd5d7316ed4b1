"""Torch releases older than the one TorchTitan 0.3.0 is written for.

TorchTitan 0.3.0 imports `torch.distributed.fsdp.DataParallelMeshDims`, which `fully_shard` takes from torch 2.13 on.
On an older torch (2.11 is the lent GPU machine's image) that one import is all that stops a single process: the
model, the logprob head, the local engine and the update run. FSDP, TP and CP need torch >= 2.13: on an older
torch the name stands in for the import alone, and a run of several processes is refused at start
(`require_multiprocess_torch`). `canopy/__init__.py` applies this before any TorchTitan import; on torch >= 2.13
it imports nothing.
"""

from importlib.metadata import PackageNotFoundError, version

from canopy.errors import ConfigError

MULTIPROCESS_TORCH = (2, 13)


def torch_version() -> tuple[int, int] | None:
    """(major, minor) of the installed torch, read from its metadata (without importing it); None without torch
    (the stdlib-only sandbox and AppWorld interpreters import `canopy` too)."""
    try:
        major, minor = version("torch").split(".")[:2]
    except PackageNotFoundError:
        return None
    return int(major), int(minor)


def multiprocess_error() -> str:
    have = ".".join(map(str, torch_version()))
    return (
        f"FSDP / TP / CP need torch >= {'.'.join(map(str, MULTIPROCESS_TORCH))} (TorchTitan 0.3.0's fully_shard "
        f"API), and this is torch {have}: run one process (every parallelism.* = 1), or install a newer torch"
    )


class NeedsNewerTorch:
    """Stands in for `DataParallelMeshDims` on torch < 2.13: importable, never usable."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(multiprocess_error())


def let_torchtitan_import(fsdp=None) -> bool:
    """On torch < 2.13, give `torch.distributed.fsdp` (or `fsdp`) the one name TorchTitan imports from it; True if
    it was added."""
    if fsdp is None:
        have = torch_version()
        if have is None or have >= MULTIPROCESS_TORCH:
            return False
        import torch.distributed.fsdp as fsdp
    if hasattr(fsdp, "DataParallelMeshDims"):
        return False
    fsdp.DataParallelMeshDims = NeedsNewerTorch
    return True


def require_multiprocess_torch(world_size: int) -> None:
    """A run of several processes needs torch >= 2.13: refuse it at start, in one line, on an older one."""
    if world_size > 1 and torch_version() < MULTIPROCESS_TORCH:
        raise ConfigError(multiprocess_error())
