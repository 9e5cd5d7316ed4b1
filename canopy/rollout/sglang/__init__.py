"""The SGLang engine (`engine.name=sglang`) on the HTTP engine core (`canopy.rollout.http`): `settings`, `servers`
(SGLang's backend: launch command, /generate request and reply, version route), `weight_sync` (disk or broadcast)
and `engine`, the `SGLangEngine` that composes them."""

from canopy.rollout.http.routing import StaleSampleError
from canopy.rollout.sglang.engine import SGLangEngine
from canopy.rollout.sglang.settings import SGLangSettings, serving_dtype

__all__ = ["SGLangEngine", "SGLangSettings", "StaleSampleError", "serving_dtype"]
