"""Weights reach every live vLLM server after each optimizer step, by disk: safetensors shards + the base config and
tokenizer streamed to <sync_dir>/v<version> (staged, renamed), then on each server /pause (in-flight requests
aborted, caches cleared) -> /collective_rpc reload_weights from that directory -> /reset_prefix_cache (no KV of the
old weights is reused) -> /update_weight_version -> /resume. Each server must then report the new version. A server
that fails its update is ejected and re-synced from the same directory when it answers again (`resync`)."""

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from canopy.models.hf_checkpoint import (
    checkpoint_dtype,
    checkpoint_weight_names,
    complete_update,
    remove_other_versions,
    write_hf_checkpoint,
)
from canopy.rollout.http.fleet import Fleet, Server


class DiskWeightSync:
    """Pushes the trainer's weights to the live servers of `fleet` through `sync_dir`; `eject` takes a server that
    failed its update out of routing."""

    def __init__(self, fleet: Fleet, model_path: Path, sync_dir: Path, shard_bytes: int, eject: Callable):
        self.fleet, self.model_path, self.sync_dir = fleet, model_path, sync_dir
        self.shard_bytes, self.eject = shard_bytes, eject
        self.weight_names = checkpoint_weight_names(model_path)
        self.sync_dtype = checkpoint_dtype(model_path)

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write `version`, push it to every live server; those that fail are ejected, and if none takes it, raise."""
        path = write_hf_checkpoint(
            complete_update(named_tensors, self.weight_names, version),
            self.model_path,
            self.sync_dir / f"v{version}",
            self.sync_dtype,
            self.shard_bytes,
        )
        live = self.fleet.live()
        with ThreadPoolExecutor(max(1, len(live))) as pushes:
            errors = list(pushes.map(lambda server: self._try_push(server, path, version), live))
        took = [server for server, error in zip(live, errors) if error is None]
        if not took:
            raise RuntimeError(
                f"no vLLM server took weight version {version}: "
                + "; ".join(str(e) for e in errors if e)
                + " (every server ejected or failing: see their logs)"
            )
        for server, error in zip(live, errors):
            if error is not None:
                self.eject(server)
        self.fleet.verify_version(version, servers=took)
        remove_other_versions(self.sync_dir, version)

    def resync(self, server: Server, version: int) -> None:
        """Bring one server (back, on other weights) to `version`, from the directory the last update wrote."""
        path = self.model_path if version == 0 else self.sync_dir / f"v{version}"
        self._push(server, path, version)
        self.fleet.verify_version(version, servers=[server])

    def _try_push(self, server: Server, path: Path, version: int) -> Exception | None:
        try:
            self._push(server, path, version)
        except RuntimeError as error:
            return error
        return None

    def _push(self, server: Server, path: Path, version: int) -> None:
        control = self.fleet.control
        control(server, "/pause?mode=abort&clear_cache=true", {})
        control(server, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        control(server, "/reset_prefix_cache", {})
        control(server, "/update_weight_version", {"new_version": str(version)})
        control(server, "/resume", {})
