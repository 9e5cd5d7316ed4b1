"""Weights reach every live vLLM server after each optimizer step (`engine.vllm.weight_sync`), then each server must
report the new version:
- disk (any device): safetensors shards + the base config and tokenizer streamed to <sync_dir>/v<version> (staged,
  renamed), then on each server /pause (in-flight requests aborted, caches cleared) -> /collective_rpc reload_weights
  from that directory -> /reset_prefix_cache (no KV of the old weights is reused) -> /update_weight_version ->
  /resume. A server that fails its update is ejected and re-synced from the same directory when it answers again.
- nccl (GPUs; vLLM's native weight transfer): the trainer opens an NCCL group with each server's workers once
  (/init_weight_transfer_engine), then per step /pause -> /start_weight_update -> one /update_weights per bucket of
  tensors, its names, dtypes and shapes, while the trainer broadcasts them in that order -> /finish_weight_update
  with the version -> /reset_prefix_cache -> /resume. A server that fails mid-transfer has its group aborted (the
  broadcasts waiting on it end) and is ejected; nothing of the weights is kept to re-sync it alone, so it takes the
  next step's update with the others (over a new group) once it answers, and is re-admitted then."""

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
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
from canopy.rollout.http.client import TRANSIENT, HTTPError, request
from canopy.rollout.http.fleet import Fleet, Server
from canopy.rollout.vllm.nccl import encode_unique_id


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


class NCCLWeightSync:
    """Broadcasts the trainer's weights to the servers of `fleet` over one NCCL group per server (trainer rank 0, the
    server's workers after it), opened through `transport` (`nccl.Transport`: `unique_id()`, `join(uid, world_size)`
    -> a group with `broadcast`, `done`, `abort`); `eject` takes a server that failed its update out of routing."""

    def __init__(self, fleet: Fleet, model_path: Path, transport, bucket_bytes: int, timeout_s: float, eject: Callable):
        self.fleet, self.transport, self.bucket_bytes, self.timeout_s, self.eject = (
            fleet, transport, bucket_bytes, timeout_s, eject
        )  # fmt: skip
        self.weight_names = checkpoint_weight_names(model_path)
        self.sync_dtype = checkpoint_dtype(model_path)
        self.groups: dict[Server, tuple[object, object]] = {}  # server -> (its group, the process it was opened with)

    def connect(self) -> None:
        """Open a group with every server, at start: a server launched without `--weight-transfer-config` (or NCCL
        missing) stops the run here, with its cause, before any rollout."""
        for server in self.fleet.servers:
            self._open(server)

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send `version` to every server that answers (live ones, and ejected ones back on their feet); those that
        fail are ejected, and if none takes it, raise."""
        targets, failed = self._targets()
        try:
            targets = self._for_each(targets, failed, "/pause?mode=abort&clear_cache=true", {})
            targets = self._for_each(targets, failed, "/start_weight_update", {})
            stream = complete_update(named_tensors, self.weight_names, version)
            for bucket in buckets(stream, self.transport.device, self.sync_dtype, self.bucket_bytes):
                targets = self._send(bucket, targets, failed)
            targets = self._for_each(targets, failed, "/finish_weight_update", {"weight_version": str(version)})
            targets = self._for_each(targets, failed, "/reset_prefix_cache", {})
            targets = self._for_each(targets, failed, "/resume", {})
        except BaseException:  # the stream broke off mid-transfer: every server may hold a mix of two versions
            for server in [*targets, *failed]:
                self._drop(server)
                self.eject(server)
            raise
        if not targets:
            raise RuntimeError(
                f"no vLLM server took weight version {version} over NCCL: "
                + "; ".join(f"{server.url}: {error}" for server, error in failed.items())
                + " (see their logs)"
            )
        for server in failed:
            self.eject(server)
        self.fleet.verify_version(version, servers=targets)

    def resync(self, server: Server, version: int) -> None:
        """The trainer keeps no copy of the weights to send one server: it takes the next step's update."""
        raise RuntimeError(f"{server.url} takes weight version {version + 1} with the others, over NCCL")

    def _targets(self) -> tuple[list[Server], dict[Server, str]]:
        """The servers to update, each with a group (a relaunched or failed one's opened anew), and those left out."""
        targets, failed = [], {}
        for server in self.fleet.servers:
            if server.ejected and not _answers(server):
                continue
            group, process = self.groups.get(server, (None, None))
            try:
                if group is None or process is not server.process:
                    self._open(server)
            except RuntimeError as error:
                failed[server] = str(error)
                continue
            targets.append(server)
        return targets, failed

    def _open(self, server: Server) -> None:
        """One group: the server joins from the trainer's unique id as the trainer does (both block until all ranks
        are in), so the trainer's side waits in a thread while the server's request runs."""
        self._drop(server)
        with contextlib.suppress(RuntimeError):  # a server holding a group from an earlier transfer releases it
            self.fleet.control(server, "/shutdown_weight_transfer_engine", {})
        uid, world_size, joined = self.transport.unique_id(), 1 + server.tp_size, {}

        def join():
            try:
                joined["group"] = self.transport.join(uid, world_size)
            except BaseException as error:  # noqa: BLE001 -- reported by the caller
                joined["error"] = error

        thread = threading.Thread(target=join, name="nccl-join", daemon=True)
        thread.start()
        init = {"nccl_unique_id_b64": encode_unique_id(uid), "rank_offset": 1, "world_size": world_size}
        try:
            self.fleet.control(server, "/init_weight_transfer_engine", {"init_info": {**init, "packed": False}})
        except RuntimeError as error:
            raise RuntimeError(
                f'{error}: launch vLLM with --weight-transfer-config \'{{"backend": "nccl"}}\' (Canopy does, for '
                "the servers it launches) or set engine.vllm.weight_sync=disk"
            ) from None
        thread.join(self.timeout_s)
        if "group" not in joined:
            raise RuntimeError(
                f"the trainer could not join {server.url}'s NCCL group: {joined.get('error', 'timeout')}"
            )
        self.groups[server] = (joined["group"], server.process)

    def _drop(self, server: Server) -> None:
        group, _ = self.groups.pop(server, (None, None))
        if group is not None:
            group.abort()

    def _for_each(self, targets: list[Server], failed: dict, path: str, body: dict) -> list[Server]:
        """One control call to each target at once; those failing it are dropped (their groups aborted)."""
        with ThreadPoolExecutor(max(1, len(targets))) as calls:
            errors = list(calls.map(lambda server: _error_of(self.fleet.control, server, path, body), targets))
        for server, error in zip(targets, errors):
            if error is not None:
                failed[server] = error
                self._drop(server)
        return [server for server, error in zip(targets, errors) if error is None]

    def _send(self, bucket: list[tuple[str, torch.Tensor]], targets: list[Server], failed: dict) -> list[Server]:
        """Each target's workers post the bucket's metadata and receive its tensors as the trainer broadcasts them
        into each group. A server whose request fails (or that has not taken the bucket by `timeout_s`) has its
        group aborted, which ends the broadcasts waiting on its workers."""
        info = {
            "names": [name for name, _ in bucket],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
            "shapes": [list(tensor.shape) for _, tensor in bucket],
        }
        calls = ThreadPoolExecutor(max(1, len(targets)))
        replies = {
            server: calls.submit(_error_of, self.fleet.control, server, "/update_weights", {"update_info": info})
            for server in targets
        }
        for _, tensor in bucket:
            for server in targets:
                self.groups[server][0].broadcast(tensor)
        deadline, waiting = time.monotonic() + self.timeout_s, set(targets)
        while waiting:
            for server in list(waiting):
                reply, group = replies[server], self.groups[server][0]
                if reply.done() and reply.result() is not None:
                    failed[server] = reply.result()
                    self._drop(server)
                elif time.monotonic() > deadline:
                    failed[server] = f"took no bucket in {self.timeout_s:.0f} s (engine.vllm.sync_timeout_s)"
                    self._drop(server)
                elif not (reply.done() and group.done()):
                    continue
                waiting.discard(server)
            time.sleep(0.001 if waiting else 0)
        calls.shutdown(wait=False)  # a timed-out request is left to its own timeout
        return [server for server in targets if server not in failed]


def _answers(server: Server) -> bool:
    try:
        request(server.url + "/health", None, timeout=5)
    except (HTTPError, *TRANSIENT):
        return False
    return True


def _error_of(call: Callable, *args) -> str | None:
    """`call(*args)`'s failure as text, None when it succeeds."""
    try:
        call(*args)
    except RuntimeError as error:
        return str(error)
    return None
