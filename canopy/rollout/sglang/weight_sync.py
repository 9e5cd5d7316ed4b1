"""Weights reach every server after each optimizer step, then the servers must report the new version:
- disk: safetensors shards + the base config / tokenizer streamed to <sync_dir>/v<version> (staged, renamed),
  then pause_generation -> update_weights_from_disk (which flushes the cache) -> continue_generation;
- distributed: trainer rank 0 joins the servers' process group once (init_weights_update_group), then
  pause -> begin_weight_update -> update_weights_from_distributed per bucket while broadcasting it -> end -> continue.
"""

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch

from canopy.models.hf_checkpoint import (
    buckets,
    checkpoint_dtype,
    checkpoint_weight_names,
    complete_update,
    remove_other_versions,
    write_hf_checkpoint,
)
from canopy.rollout.http.fleet import Fleet
from canopy.rollout.sglang.settings import SGLangSettings

GROUP_NAME = "canopy_weight_sync"
BUCKET_BYTES = 1 << 30  # distributed: tensors per update_weights_from_distributed call (the trainer holds one)


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str):
    """A process group beside the default one (which may be Lightning's), rendezvousing at `init_method` with keys
    prefixed by `group_name`: the trainer's end of the group each server builds in /init_weights_update_group."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(minutes=30)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_from_trainer(tensor: torch.Tensor, group) -> None:
    torch.distributed.broadcast(tensor, src=0, group=group)


class WeightSync:
    """Pushes the trainer's weights to every server of `fleet`, by disk or by broadcast (`settings.weight_sync`)."""

    def __init__(
        self,
        fleet: Fleet,
        settings: SGLangSettings,
        model_path: Path,
        sync_dir: Path,
        shard_bytes: int,
        bucket_bytes: int,
        init_group: Callable,
        broadcast: Callable,
    ):
        self.fleet, self.settings, self.model_path, self.sync_dir = fleet, settings, model_path, sync_dir
        self.weight_names = checkpoint_weight_names(model_path)
        self.sync_dtype = checkpoint_dtype(model_path)
        self.shard_bytes, self.bucket_bytes = shard_bytes, bucket_bytes
        self.init_group, self.broadcast, self.group = init_group, broadcast, None

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push the trainer's (HF name, tensor) stream to every server, which must then serve `version`.
        Every weight of the base checkpoint must come, and nothing else: a partial update would mix two policies."""
        if self.settings.weight_sync == "disk":
            path = write_hf_checkpoint(
                complete_update(named_tensors, self.weight_names, version),
                self.model_path,
                self.sync_dir / f"v{version}",
                self.sync_dtype,
                self.shard_bytes,
            )
            self.fleet.for_all("/pause_generation", {"mode": "abort"})
            # flush_cache: no KV computed by the old weights survives, and the update fails if the cache cannot be
            # flushed (requests still running); SGLang's default, stated
            body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
            self.fleet.for_all("/update_weights_from_disk", body)
            self.fleet.for_all("/continue_generation", {})
        else:
            self._sync_distributed(complete_update(named_tensors, self.weight_names, version), version)
        self.fleet.verify_version(version)
        if self.settings.weight_sync == "disk":
            remove_other_versions(self.sync_dir, version)

    def _sync_distributed(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        if self.group is None:
            self.group = self._init_group()
        self.fleet.for_all("/pause_generation", {"mode": "abort"})
        self.fleet.for_all("/begin_weight_update", {})
        pending = None  # one bucket held back, so the last one can carry the new weight_version
        device = "cuda" if self.settings.sync_backend == "nccl" else "cpu"
        for bucket in buckets(named_tensors, device, self.sync_dtype, self.bucket_bytes):
            if pending is not None:
                self._send_bucket(pending, None)
            pending = bucket
        if pending is not None:
            self._send_bucket(pending, str(version))
        self.fleet.for_all("/end_weight_update", {})
        self.fleet.for_all("/continue_generation", {})

    def _init_group(self):
        """Trainer rank 0 plus every server's TP ranks (rank offsets counted from 1), formed concurrently."""
        s, servers = self.settings, self.fleet.servers
        offsets = [1 + sum(server.tp_size for server in servers[:i]) for i in range(len(servers))]
        world_size = 1 + sum(server.tp_size for server in servers)
        with ThreadPoolExecutor(len(servers)) as requests:
            replies = [
                requests.submit(
                    self.fleet.control,
                    server,
                    "/init_weights_update_group",
                    {
                        "master_address": s.sync_master_addr,
                        "master_port": s.sync_master_port,
                        "rank_offset": offset,
                        "world_size": world_size,
                        "group_name": GROUP_NAME,
                        "backend": s.sync_backend,
                    },
                )
                for server, offset in zip(servers, offsets)
            ]
            init_method = f"tcp://{s.sync_master_addr}:{s.sync_master_port}"
            group = self.init_group(s.sync_backend, init_method, world_size, 0, GROUP_NAME)
            for reply in replies:
                reply.result()
        return group

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        """Every server posts the bucket's metadata, then receives its tensors as the trainer broadcasts them."""
        body = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": GROUP_NAME,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        with ThreadPoolExecutor(len(self.fleet.servers)) as requests:
            path = "/update_weights_from_distributed"
            replies = [requests.submit(self.fleet.control, server, path, body) for server in self.fleet.servers]
            for _, tensor in bucket:
                self.broadcast(tensor, self.group)
            for reply in replies:
                reply.result()
