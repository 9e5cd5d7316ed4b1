"""Checkpoints that appear whole or not at all.

Under `ModelParallelStrategy` a checkpoint is a DCP directory that every rank writes its shards into, and rank 0
adds `.metadata` and Lightning's `meta.pt`; a kill part-way would leave a directory that looks like a checkpoint.
`AtomicCheckpoint` writes each checkpoint (directory or single file) to `<name>.tmp` and rank 0 renames it once
every rank has finished. A `.tmp` left behind by a killed save is never resumed from and is removed by the next save.
`checkpoint_kind` tells what a path given as a checkpoint holds, so that a wrong one is refused before anything runs.
"""

import os
import shutil
import zipfile
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

STAGING_SUFFIX = ".tmp"


def checkpoint_kind(path: str | Path) -> str:
    """What `path` holds, read without loading a tensor: `missing`; `hf` (an HF model directory: config.json);
    `ckpt` (a single-file Lightning checkpoint: torch.save's zip archive whose pickle holds a `state_dict`);
    `sharded` (a finished sharded checkpoint: .metadata and meta.pt); `unfinished` (a directory with only part of
    one, or a staging `.tmp`); `other` (none of these)."""
    path = Path(path)
    if not path.exists():
        return "missing"
    if path.is_file():
        return "ckpt" if _is_lightning_file(path) else "other"
    if (path / "config.json").is_file():
        return "hf"
    marks = [(path / name).is_file() for name in (".metadata", "meta.pt")]
    if all(marks):
        return "sharded"
    if any(marks) or next(path.glob("*.distcp"), None) or path.name.endswith(STAGING_SUFFIX):
        return "unfinished"
    return "other"


def _is_lightning_file(path: Path) -> bool:
    """torch.save writes a zip archive with one pickle, `<name>/data.pkl` (the tensors are separate entries)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickle = next((name for name in archive.namelist() if name.endswith("/data.pkl")), None)
            return pickle is not None and b"state_dict" in archive.read(pickle)
    except (zipfile.BadZipFile, OSError):
        return False


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def publish(staging: Path, final: Path) -> None:
    """Move a finished checkpoint into place, replacing an older one of the same name (e.g. `last.ckpt`)."""
    if final.is_dir() or (final.exists() and staging.is_dir()):
        old = final.with_name(final.name + ".old" + STAGING_SUFFIX)  # removed by the next save if we die here
        os.replace(final, old)
        os.replace(staging, final)
        _remove(old)
    else:
        os.replace(staging, final)  # atomic for a single file


class AtomicCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that stages every save in `<name>.tmp` and renames it on rank 0 after all ranks finished."""

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        staging = Path(filepath + STAGING_SUFFIX)
        if trainer.is_global_zero:
            for leftover in staging.parent.glob("*" + STAGING_SUFFIX):  # from a save that was killed
                _remove(leftover)
        trainer.strategy.barrier("AtomicCheckpoint.clean")
        super()._save_checkpoint(trainer, str(staging))  # every rank writes its part, then waits for the others
        if trainer.is_global_zero:
            publish(staging, Path(filepath))
        trainer.strategy.barrier("AtomicCheckpoint.publish")
        self._last_checkpoint_saved = filepath
