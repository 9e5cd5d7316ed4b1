"""The SGLang engine: LocalEngine's contract served by SGLang HTTP servers (GPU, their own venv; sglang >= 0.5.21).

Each prompt is one `/generate` request (token ids in, `return_logprob`), routed per episode (`routing`) to the servers
the engine launched or attached (`servers`); weights reach every server after each optimizer step (`weight_sync`).

Returned logprobs: with SGLANG_RETURN_ORIGINAL_LOGPROB off (forced off for servers we launch), SGLang gives
log softmax(logits / temperature) over the whole vocabulary, before top-k / top-p, as LocalEngine does and as the
trainer scores (`token_logprobs` at the sampling temperature).
"""

import atexit
import contextlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from canopy.rollout.engine import EngineFault, Generation, SamplingParams
from canopy.rollout.sglang.routing import Aborted, Router, StaleSampleError
from canopy.rollout.sglang.servers import Fleet
from canopy.rollout.sglang.settings import SGLangSettings, serving_dtype
from canopy.rollout.sglang.weight_sync import WeightSync, broadcast_from_trainer, init_custom_process_group


class SGLangEngine:
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
        bucket_bytes: int = 1 << 30,
        init_group: Callable = init_custom_process_group,
        broadcast: Callable = broadcast_from_trainer,
    ):
        self.model_path = Path(model_path).resolve()
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.settings = settings
        self.context_length, self.rope_scaling, self.seed = context_length, rope_scaling, seed
        sync_dir = Path(settings.sync_dir).resolve()  # weight checkpoints and server logs
        self.fleet = Fleet(settings, self.model_path, sync_dir)
        self.weight_sync = WeightSync(
            self.fleet, settings, self.model_path, sync_dir, shard_bytes, bucket_bytes, init_group, broadcast
        )
        self.dtype = serving_dtype(settings.extra_args, self.model_path)
        sync_dir.mkdir(parents=True, exist_ok=True)
        self.router = Router(self.fleet, settings, retry_backoff_s, health_interval_s)
        atexit.register(self.close)
        try:
            self.fleet.start(context_length, rope_scaling, seed)
        except BaseException:
            self.close()
            raise
        self.pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="sglang-request")

    @property
    def weight_version(self) -> int:
        """The version every server was last verified to serve: each sample must carry it."""
        return self.fleet.weight_version

    # ---- servers -------------------------------------------------------------------------------------------------

    def at_budget(self, context_length: int, rope_scaling: dict | None) -> "SGLangEngine | None":
        """Itself when its servers run with this RoPE scaling and at least this context; else None: the servers
        would need a relaunch (`relaunched`), which only the end of training can afford."""
        fits = self.context_length is None or context_length <= self.context_length
        return self if fits and (rope_scaling or None) == (self.rope_scaling or None) else None

    @property
    def can_relaunch(self) -> bool:
        """Whether this engine launched its servers (attached ones belong to someone else: never relaunched)."""
        return not self.settings.urls

    @contextlib.contextmanager
    def relaunched(self, context_length: int, rope_scaling: dict | None):
        """Inside the block, the servers run relaunched on the same ports and GPUs with this context length and
        RoPE scaling, from the base weights at version 0 (push the policy's weights next); afterwards they are
        relaunched with the training settings, again at the base weights (push them again)."""
        if not self.can_relaunch:
            raise RuntimeError("attached SGLang servers (engine.sglang.urls) are never relaunched by Canopy")
        training = (self.context_length, self.rope_scaling)
        try:
            self._relaunch(context_length, rope_scaling)
            yield self
        finally:
            self._relaunch(*training)

    def _relaunch(self, context_length: int | None, rope_scaling: dict | None) -> None:
        self.fleet.relaunch(context_length, rope_scaling, self.seed)
        self.context_length, self.rope_scaling = context_length, rope_scaling

    def evaluation_seed(self, seed: int):
        """SGLang's sampling state lives in the servers and is per request: nothing to save or restore."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Stop the servers this engine launched (their whole process groups)."""
        self.router.close()
        self.fleet.stop()
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- generation ----------------------------------------------------------------------------------------------

    concurrent = True  # serves each episode's request as it comes (`run_episodes` sends them one by one)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        sampling: SamplingParams,
        keys: list[str | None] | None = None,
    ) -> list[Generation | EngineFault]:
        """One concurrent request per prompt; `keys` (one per prompt: its episode) make routing sticky. A request that
        fails on every try comes back as an `EngineFault` in its slot; one that gets a stale sample on every try (no
        server holds the engine's weights) or that a server rejects as invalid raises."""
        keys = keys or [None] * len(prompts)
        futures = [
            self.pool.submit(self._generate_one, p, n, sampling, key)
            for p, n, key in zip(prompts, max_new_tokens, keys)
        ]
        return [future.result() for future in futures]

    def release(self, keys: Iterable[str]) -> None:
        """These episodes ended: forget their routes."""
        self.router.forget(keys)

    def request_body(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams) -> dict:
        return {
            "input_ids": list(prompt),
            "sampling_params": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "max_new_tokens": max_new_tokens,
                "stop_token_ids": self.stop_token_ids,
                "skip_special_tokens": False,
                "no_stop_trim": True,
            },
            "return_logprob": True,
        }

    def _generate_one(
        self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, key: str | None = None
    ) -> Generation | EngineFault:
        if max_new_tokens <= 0:
            return Generation([], [], "length", self.weight_version)
        return self.router.generate(self.request_body(prompt, max_new_tokens, sampling), key, self.parse)

    def parse(self, reply: dict) -> Generation:
        """A /generate reply -> Generation; the sample must come from the engine's current weight version."""
        meta = reply["meta_info"]
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort":
            raise Aborted(finish.get("message", "aborted"))
        if finish.get("type") not in ("stop", "length"):
            raise RuntimeError(f"SGLang finished a request with {finish!r}: expected stop or length")
        versions = {span["version"] for span in meta.get("weight_versions", [])} | {meta.get("weight_version")}
        if versions != {str(self.weight_version)}:
            raise StaleSampleError(
                f"SGLang sampled with weight version(s) {sorted(map(str, versions))} but the engine holds "
                f"{self.weight_version}: a server missed a weight sync; restart it or re-sync"
            )
        logprobs = meta["output_token_logprobs"]  # [[logprob, token id, text or null], ...]
        ids, values = [int(t) for _, t, _ in logprobs], [float(lp) for lp, _, _ in logprobs]
        return Generation(ids, values, finish["type"], self.weight_version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push the trainer's (HF name, tensor) stream to every server; later samples must carry `version`.
        Every weight of the base checkpoint must come, and nothing else: a partial update would mix two policies."""
        self.weight_sync.update(named_tensors, version)
