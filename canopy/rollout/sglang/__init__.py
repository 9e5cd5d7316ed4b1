"""The SGLang engine (`engine.name=sglang`): `settings`, `servers` (launch, attach, health, control calls),
`routing` (per-episode routing and retries of /generate), `weight_sync` (disk or broadcast) and `engine`, the
`SGLangEngine` that composes them."""

from canopy.rollout.sglang.engine import SGLangEngine
from canopy.rollout.sglang.routing import StaleSampleError
from canopy.rollout.sglang.settings import SGLangSettings, serving_dtype

__all__ = ["SGLangEngine", "SGLangSettings", "StaleSampleError", "serving_dtype"]
