"""The vLLM engine (`engine.name=vllm`) on the HTTP engine core (`canopy.rollout.http`): `settings`, `servers`
(vLLM's backend: launch command, /inference/v1/generate request and reply, version routes), `weight_sync` (disk,
with re-sync of a recovered server) and `engine`, the `VLLMEngine` that composes them."""

from canopy.rollout.vllm.engine import VLLMEngine
from canopy.rollout.vllm.settings import VLLMSettings

__all__ = ["VLLMEngine", "VLLMSettings"]
