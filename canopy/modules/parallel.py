"""Sharding the policy with TorchTitan: FSDP2 (data-parallel shard) x tensor parallel (+ sequence parallel),
and context parallel on GPUs, from the device mesh of Lightning's `ModelParallelStrategy`.

Meshes (TorchTitan's `ParallelDims`): "batch" = the data-parallel shards (dp_replicate x dp_shard), which train on
distinct rows; "cp" = the context-parallel ranks of one shard, which hold distinct positions of the same rows;
"loss" = batch x cp, every rank holding distinct tokens, over which the gradients are summed (FSDP's reduce-scatter
over dp_shard x cp, then HSDP's all-reduce over dp_replicate); TP ranks hold the same tokens.

The model is built on the meta device, parallelized by its family's TorchTitan function (`ModelSpec.parallelize`,
e.g. `parallelize_qwen3`), then filled from the HF checkpoint a tensor (or a decoder layer) at a time: each rank
memory-maps the safetensors, converts HF tensors to their TorchTitan names and keeps only its own shard of them, so
no rank ever materializes the whole model.
"""

import logging
import multiprocessing
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from canopy.errors import ConfigError, require
from canopy.models import family_of
from canopy.modules.policy import read_hf_config


@dataclass(frozen=True)
class ParallelSettings:
    """`parallelism.*`: degrees of each dimension and the FSDP numerics, the schema and the only defaults of those
    keys. Processes = dp_replicate x dp_shard x tp x cp = trainer.devices x trainer.num_nodes."""

    dp_shard: int = 1  # FSDP2 shards
    tp: int = 1  # tensor parallel, with sequence parallel
    dp_replicate: int = 1  # HSDP: replicas of the dp_shard-way sharded model (typically one per node), gradients
    # summed over all
    cp: int = 1  # context parallel (sequence split, head-tail balanced): GPUs only, token-mean only
    sequence_parallel: bool = True
    mixed_precision: str = "float32"  # FSDP compute dtype: float32 | bfloat16 (reductions stay float32)
    activation_checkpointing: str = "none"  # none | full | selective (TorchTitan's per-block policies)

    @property
    def world(self) -> int:
        """Processes: dp_replicate x dp_shard x tp x cp."""
        return self.dp_replicate * self.dp_shard * self.tp * self.cp

    def validate(self) -> None:
        for key in ("dp_replicate", "dp_shard", "tp", "cp"):
            require(getattr(self, key) >= 1, f"parallelism.{key}={getattr(self, key)} must be a positive integer")
        require(
            self.mixed_precision in ("float32", "bfloat16"),
            f"parallelism.mixed_precision={self.mixed_precision!r} is unknown: use float32 or bfloat16",
        )
        require(
            self.activation_checkpointing in ("none", "full", "selective"),
            f"parallelism.activation_checkpointing={self.activation_checkpointing!r} is unknown: use none, full or "
            "selective",
        )


def activation_checkpointing_config(mode: str):
    """TorchTitan's activation-checkpointing policy for `mode`, or None."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    configs = {"none": None, "full": FullAC.Config, "selective": SelectiveAC.Config}
    if mode not in configs:
        raise ConfigError(f"parallelism.activation_checkpointing={mode!r} is unknown: use none, full or selective")
    return configs[mode]() if configs[mode] else None


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Recompute each transformer block's activations in backward (single-process path)."""
    config = activation_checkpointing_config(mode)
    if config is not None:
        config.build(dump_folder="/tmp").apply(model)
    return model


def build_parallel_policy(
    path: str | Path,
    settings: ParallelSettings,
    world_size: int,
    device: torch.device,
    trainable: bool = True,
    dims=None,
):
    """Meta-build the TorchTitan model of `path`'s family (`canopy.models`), parallelize it over `world_size`
    processes, and load its HF weights. The frozen reference (`trainable=False`) is sharded the same way (pass the
    policy's `dims` to reuse its meshes), without activation checkpointing."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    hf = read_hf_config(path)
    spec = family_of(hf)
    if spec.cpu_tp_cp_refusal and (settings.tp > 1 or settings.cp > 1) and device.type == "cpu":
        raise ConfigError(spec.cpu_tp_cp_refusal)
    spec.require_context_parallel(settings.cp)

    if settings.world != world_size:
        raise ConfigError(
            f"parallelism.dp_replicate={settings.dp_replicate} x dp_shard={settings.dp_shard} x tp={settings.tp} x "
            f"cp={settings.cp} must equal the {world_size} processes (trainer.devices x trainer.num_nodes)"
        )
    parallel_dims_module.device_type = device.type  # TorchTitan builds its meshes on this device type
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=settings.dp_replicate,
        data_parallel_shard_degree=settings.dp_shard,
        tensor_parallel_degree=settings.tp,
        context_parallel_degree=settings.cp,
        enable_sequence_parallel=settings.sequence_parallel,
        spmd_backend="partial_dtensor",
    )
    if dims is None:
        dims = ParallelDims.from_config(parallelism, world_size)
        dims.build_mesh()
    config, model = spec.build(hf, _WithParallelism(parallelism))
    adapter = spec.checkpoint(config, hf, path)
    if settings.dp_shard > 1 and settings.tp > 1 and config.vocab_size % (settings.dp_shard * settings.tp):
        raise ConfigError(
            f"vocab_size={config.vocab_size} must be divisible by dp_shard x tp = {settings.dp_shard * settings.tp} "
            "for FSDP x TP: pad the vocabulary (Qwen3's 151,936 is) or use one of the two"
        )
    spec.parallelize(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=settings.mixed_precision, mixed_precision_reduce="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=activation_checkpointing_config(settings.activation_checkpointing) if trainable else None,
        dump_folder="/tmp",
    )
    model.to_empty(device=device)
    model.init_states(buffer_device=device)
    adapter.load_sharded(model, path)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # the loss is already divided by the global action-token count (Eq. 8), so gradients are summed
            # over every rank holding distinct tokens (dp_replicate x dp_shard x cp), not averaged (gloo has no
            # PREMUL_SUM either)
            module.set_force_sum_reduction_for_comms(True)
    return model, adapter, dims


class _WithParallelism:
    """The minimal config object TorchTitan's `update_from_config` reads."""

    def __init__(self, parallelism):
        self.parallelism = parallelism


def _mesh(dims, name: str):
    """TorchTitan's `name` mesh ("batch", "cp" or "loss") when it spans several ranks, else None."""
    mesh = None if dims is None else dims.get_optional_mesh(name)
    return mesh if mesh is not None and mesh.size() > 1 else None


def data_parallel_rank(dims) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel shards; TP / CP ranks of one shard share its rows."""
    mesh = _mesh(dims, "batch")
    return (0, 1) if mesh is None else (mesh.get_local_rank(), mesh.size())


def context_parallel_mesh(dims):
    """The mesh over which one shard's sequences are split (context parallel), or None."""
    return _mesh(dims, "cp")


def _comm_device(mesh) -> torch.device:
    """Where `mesh`'s collectives take their tensors: NCCL wants them on this rank's GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def all_reduce_sum(values: dict[str, float], dims, over: str = "loss") -> dict[str, float]:
    """Sum per-rank partials over `over`: "loss" for partials of each rank's own tokens (batch x cp),
    "batch" for counts of each data-parallel shard's own rows."""
    mesh = _mesh(dims, over)
    if mesh is None:
        return values
    keys = sorted(values)
    packed = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=_comm_device(mesh))
    dist.all_reduce(packed, group=mesh.get_group())
    return dict(zip(keys, packed.tolist()))


def all_reduce_max(value: int, dims) -> int:
    """The largest `value` over the ranks holding distinct tokens (e.g. micro-batch counts, which must agree for
    the gradient collectives of FSDP and HSDP)."""
    mesh = _mesh(dims, "loss")
    if mesh is None:
        return value
    packed = torch.tensor([value], dtype=torch.int64, device=_comm_device(mesh))
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return int(packed.item())


def sum_over_context(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """`tensor` summed over the context-parallel ranks (e.g. per-sequence sums of each rank's positions)."""
    if mesh is None:
        return tensor
    tensor = tensor.clone()
    dist.all_reduce(tensor, group=mesh.get_group())
    return tensor


def gather_sequence(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """Concatenate every context-parallel rank's [B, T/cp] slice along the sequence, in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(mesh.size())]
    dist.all_gather(parts, tensor.contiguous(), group=mesh.get_group())
    return torch.cat(parts, dim=1)


def gather_on_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor on global rank 0, and a meta tensor of its shape (no memory) on every other rank: weight
    sync and export need it on rank 0 only. A tensor sharded along one dimension (FSDP, HSDP, TP alone) is gathered
    straight into rank 0 over the one group holding its shards; other layouts (FSDP x TP's strided shards) are
    all-gathered, then dropped off rank 0. A collective: every rank calls it, in the same order."""
    mesh = tensor.device_mesh if isinstance(tensor, DTensor) else None
    sharded = [] if mesh is None else [(d, p) for d, p in enumerate(tensor.placements) if split(p, mesh.size(d))]
    if not sharded:  # whole on every rank already
        whole = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return whole if dist.get_rank() == 0 else whole.to("meta")
    if len(sharded) != 1 or type(sharded[0][1]) is not Shard:
        full = tensor.full_tensor()
        return full if dist.get_rank() == 0 else full.to("meta")
    mesh_dim, placement = sharded[0]
    rank0 = [int(i) for i in (mesh.mesh == 0).nonzero()[0]]
    mine = mesh.get_coordinate()
    if any(a != b for d, (a, b) in enumerate(zip(mine, rank0)) if d != mesh_dim):
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")  # a replica rank 0 does not gather from
    dim, shards = placement.dim, mesh.size(mesh_dim)
    chunk = -(-tensor.shape[dim] // shards)  # torch.chunk's sizes: full chunks first, then the rest, then empty
    local = tensor.to_local()
    padding = [0, 0] * (local.dim() - dim - 1) + [0, chunk - local.shape[dim]]
    padded = torch.nn.functional.pad(local, padding).contiguous()
    parts = [torch.empty_like(padded) for _ in range(shards)] if dist.get_rank() == 0 else None
    dist.gather(padded, parts, dst=0, group=mesh.get_group(mesh_dim))
    if dist.get_rank() != 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return torch.cat(parts, dim=dim).narrow(dim, 0, tensor.shape[dim])


def split(placement, ranks: int) -> bool:
    """Whether `placement` over `ranks` ranks splits the tensor (a shard over one rank holds all of it)."""
    return not placement.is_replicate() and ranks > 1


def alone_on_rank0(trainer, key: str, what: str, work):
    """`work()` on global rank 0 while the other ranks wait for it on the process group's store, outside any
    collective (whose timeout is sized for collectives, not for a rollout step or an evaluation), for at most the
    data module's `rollout_timeout_s`, then stop with one line naming the key. `work`'s result on rank 0, None
    elsewhere; `key` names this piece of work uniquely (every rank counts its pieces alike)."""
    store = dist.distributed_c10d._get_default_store() if trainer.world_size > 1 else None
    if not trainer.is_global_zero:
        timeout_s = trainer.datamodule.rollout_timeout_s
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as error:
            raise RuntimeError(
                f"rank {dist.get_rank()} waited {timeout_s} s for rank 0's {what} and gave up ({error}): raise "
                "trainer.rollout_timeout_s, or see rank 0's log for why it stopped"
            ) from None
        return None
    try:
        return work()
    finally:
        if store is not None:
            store.set(key, "1")


def end_rank() -> None:
    """End a finished rank without the interpreter's finalization (`os._exit(0)`), its process group destroyed,
    its logs flushed and its child processes ended first.

    Why: `destroy_process_group` drops only c10d's own references; the device meshes' groups stay referenced (by the
    DTensor specs torch caches) until the interpreter exits, and their gloo worker threads may still be releasing a
    finished collective's tensors. Such a thread waits for the GIL to free their PyObjects; when finalization gives
    it the GIL, CPython ends the thread with pthread_exit, whose unwinding through a noexcept destructor calls
    std::terminate: 'terminate called without an active exception', SIGABRT, in a rank whose work was done (seen in
    the multi-process tests and once in scripts/gpu_check_parallel.py; provoked by tests/gloo_teardown_worker.py).
    Without finalization there is no such hand-over. Callers write their results first."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for child in multiprocessing.active_children():  # what multiprocessing's exit hook would have ended
        child.terminate()
        child.join(timeout=10)
    logging.shutdown()  # flushes and closes the run's log files (train.log)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
