"""The SGLang engine: LocalEngine's contract served by SGLang HTTP servers (GPU, their own venv; sglang >= 0.5.21),
on the HTTP engine core (`canopy.rollout.http`) with SGLang's backend (`servers`) and weight sync (`weight_sync`).

Returned logprobs: with SGLANG_RETURN_ORIGINAL_LOGPROB off (forced off for servers we launch), SGLang gives
log softmax(logits / temperature) over the whole vocabulary, before top-k / top-p, as LocalEngine does and as the
trainer scores (`token_logprobs` at the sampling temperature).
"""

from collections.abc import Callable
from pathlib import Path

from canopy.rollout.http.engine import HTTPEngine
from canopy.rollout.http.fleet import Fleet
from canopy.rollout.http.routing import Router
from canopy.rollout.sglang.servers import SGLang
from canopy.rollout.sglang.settings import SGLangSettings, serving_dtype
from canopy.rollout.sglang.weight_sync import (
    BUCKET_BYTES,
    WeightSync,
    broadcast_from_trainer,
    init_custom_process_group,
)


class SGLangEngine(HTTPEngine):
    """Generates over SGLang servers; weights pushed after every step, each sample checked for the current version."""

    def __init__(
        self,
        model_path: str | Path,
        stop_token_ids: list[int],
        settings: SGLangSettings,
        *,
        context_length: int | None = None,
        rope_scaling: dict | None = None,
        seed: int = 0,
        retry_backoff_s: float = 1.0,
        health_interval_s: float = 5.0,
        shard_bytes: int = 4 << 30,
        bucket_bytes: int = BUCKET_BYTES,
        init_group: Callable = init_custom_process_group,
        broadcast: Callable = broadcast_from_trainer,
    ):
        self.model_path = Path(model_path).resolve()
        self.stop_token_ids = sorted(set(stop_token_ids))
        sync_dir = Path(settings.sync_dir).resolve()  # weight checkpoints and server logs
        sync_dir.mkdir(parents=True, exist_ok=True)
        fleet = Fleet(settings, SGLang(settings, self.model_path, self.stop_token_ids), sync_dir, settings.tp_size)
        weight_sync = WeightSync(
            fleet, settings, self.model_path, sync_dir, shard_bytes, bucket_bytes, init_group, broadcast
        )
        router = Router(fleet, retry_backoff_s, health_interval_s, gateway_url=settings.router_url)
        dtype = serving_dtype(settings.extra_args, self.model_path)
        super().__init__(
            fleet, router, weight_sync, dtype, context_length=context_length, rope_scaling=rope_scaling, seed=seed
        )
