"""Writing an HF-format checkpoint directory, whatever the family: the trainer's exports and the SGLang engine's
disk weight sync both stream the policy's HF-named tensors through `write_hf_checkpoint`."""

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def write_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    base_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    shard_bytes: int = 4 << 30,
) -> Path:
    """Stream (HF name, tensor) pairs into an HF checkpoint directory: safetensors shards of about `shard_bytes`
    written as the tensors come (never the whole model in memory) + their index + the base checkpoint's other
    files (config, tokenizer). Staged next to `out_dir` and renamed into place: never half-written."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        weight_map, shard, size, total = {}, {}, 0, 0
        for name, tensor in named_tensors:
            shard[name] = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
            size += shard[name].nbytes
            if size >= shard_bytes:
                total += _save_shard(staging, shard, weight_map)
                shard, size = {}, 0
        if shard or not weight_map:
            total += _save_shard(staging, shard, weight_map)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        for file in Path(base_path).iterdir():
            if file.is_file() and not any(file.match(pattern) for pattern in WEIGHT_FILES):
                shutil.copy2(file, staging / file.name)
        if out_dir.exists():  # a resumed run re-writes the version it stopped at
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
        return out_dir
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json")  # not copied from the base checkpoint


def _save_shard(directory: Path, shard: dict[str, torch.Tensor], weight_map: dict[str, str]) -> int:
    name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save_file(shard, directory / name, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, name))
    return sum(t.nbytes for t in shard.values())


def checkpoint_weight_names(path: Path) -> set[str]:
    """The names of the checkpoint's weights (its *.safetensors): exactly what every weight update must bring."""
    names = set()
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            names.update(f.keys())
    if not names:
        raise FileNotFoundError(f"model.path '{path}' has no *.safetensors weights: point it at an HF checkpoint dir")
    return names


def checkpoint_dtype(path: Path) -> torch.dtype | None:
    """The dtype config.json declares (weights are synced in it), or None to keep the trainer's."""
    config = json.loads((Path(path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) else None


def complete_update(
    named_tensors: Iterable[tuple[str, torch.Tensor]], weight_names: set[str], version: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's (HF name, tensor) stream, checked as it passes: every weight of the base checkpoint must come,
    and nothing else; a partial update would mix two policies."""
    missing = set(weight_names)
    for name, tensor in named_tensors:
        if name not in weight_names:
            raise KeyError(f"weight update names {name!r}, which the engine's model does not have")
        missing.discard(name)
        yield name, tensor
    if missing:
        raise RuntimeError(
            f"weight update to version {version} missed {sorted(missing)[:3]}: engine weights would be mixed"
        )


def native_positions(model_path: str | Path) -> int:
    """The checkpoint's own context (config.json's max_position_embeddings)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config.get("text_config", {})["max_position_embeddings"])


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], device, dtype: torch.dtype | None, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream in buckets of about `bucket_bytes`, each tensor contiguous on `device` in `dtype` (None: its own):
    what a broadcast weight sync sends per request, holding one bucket at a time."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        bucket.append((name, tensor.detach().to(device, dtype or tensor.dtype).contiguous()))
        size += bucket[-1][1].nbytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def remove_other_versions(sync_dir: Path, version: int) -> None:
    """Delete the weight folders `<sync_dir>/v<n>` of every version but `version` (the servers now serve it)."""
    for old in Path(sync_dir).glob("v*"):
        if old.is_dir() and old.name != f"v{version}":
            shutil.rmtree(old)
