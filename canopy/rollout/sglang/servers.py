"""SGLang's side of the HTTP engine core (`canopy.rollout.http`): servers launched with `python -m
sglang.launch_server` from the SGLang venv's python, ready once /health_generate answers, one /generate per prompt,
the weight version read from /model_info."""

import json
from pathlib import Path

from canopy.rollout.engine import Generation, SamplingParams
from canopy.rollout.http.fleet import Fleet
from canopy.rollout.http.routing import Aborted, StaleSampleError
from canopy.rollout.sglang.settings import SGLangSettings

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # the gateway's session key (its manual / consistent_hashing policies)


def launch_command(
    settings: SGLangSettings,
    model_path: str | Path,
    index: int,
    context_length: int | None,
    rope_scaling: dict | None,
    seed: int,
) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment of the `index`-th server (port and GPUs counted up from the base ones)."""
    s = settings
    argv = [
        s.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        s.host,
        "--port",
        str(s.base_port + index),
        "--tp-size",
        str(s.tp_size),
        "--base-gpu-id",
        str(s.base_gpu_id + index * s.tp_size),
        "--mem-fraction-static",
        str(s.mem_fraction),
        "--weight-version",
        "0",
        "--random-seed",
        str(seed + index),
    ]
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}  # logprobs of the temperature-scaled distribution
    if context_length is not None:
        argv += ["--context-length", str(context_length)]
    if rope_scaling:  # YaRN past the native context (enlarged budget)
        argv += ["--json-model-override-args", json.dumps({"rope_scaling": dict(rope_scaling)})]
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    return argv + list(s.extra_args), env


class SGLang:
    """The SGLang backend (`ServerBackend`) of `settings`' servers, serving `model_path`."""

    name, key = "SGLang", "engine.sglang"
    ready_path, generate_path, version_path = "/health_generate", "/generate", "/model_info"
    routing_header = ROUTING_KEY_HEADER

    def __init__(self, settings: SGLangSettings, model_path: Path, stop_token_ids: list[int]):
        self.settings, self.model_path, self.stop_token_ids = settings, model_path, stop_token_ids

    def launch_command(self, index: int, context_length: int | None, rope_scaling: dict | None, seed: int):
        return launch_command(self.settings, self.model_path, index, context_length, rope_scaling, seed)

    def start_version(self, fleet: Fleet) -> None:
        """Launched servers start at version 0 (`--weight-version 0`); an attached one may hold any weights: reset."""
        if self.settings.urls:
            fleet.for_all("/update_weights_from_disk", {"model_path": str(self.model_path), "weight_version": "0"})

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

    def parse(self, reply: dict, version: int) -> Generation:
        """A /generate reply -> Generation; the sample must come from the engine's current weight version."""
        meta = reply["meta_info"]
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort":
            raise Aborted(finish.get("message", "aborted"))
        if finish.get("type") not in ("stop", "length"):
            raise RuntimeError(f"SGLang finished a request with {finish!r}: expected stop or length")
        versions = {span["version"] for span in meta.get("weight_versions", [])} | {meta.get("weight_version")}
        if versions != {str(version)}:
            raise StaleSampleError(
                f"SGLang sampled with weight version(s) {sorted(map(str, versions))} but the engine holds "
                f"{version}: a server missed a weight sync; restart it or re-sync"
            )
        logprobs = meta["output_token_logprobs"]  # [[logprob, token id, text or null], ...]
        ids, values = [int(t) for _, t, _ in logprobs], [float(lp) for lp, _, _ in logprobs]
        return Generation(ids, values, finish["type"], version)
