"""The model families Canopy trains, each a folder `canopy/models/<family>/` exposing its `SPEC` (`ModelSpec`, in
canopy/models/spec.py); this registry is the one place that lists them (docs/model_families.md). Model code imports
nothing of Canopy's trainer, engines or environments."""

from canopy.errors import ConfigError
from canopy.models import qwen3, qwen3_5
from canopy.models.spec import ModelSpec

MODEL_FAMILIES: dict[str, ModelSpec] = {"qwen3": qwen3.SPEC, "qwen3_5": qwen3_5.SPEC}  # model.family: its spec
DEFAULT_FAMILY = "qwen3"  # conf/train.yaml's model.family; its chat markers serve a tokenizer that names no family


def get_family(name: str, key: str = "model.family") -> ModelSpec:
    """The spec of family `name` (set by config key `key`), or a one-line error naming the known families."""
    if name not in MODEL_FAMILIES:
        raise ConfigError(f"{key}={name!r} is unknown: use one of {', '.join(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[name]


def family_of(hf: dict) -> ModelSpec | None:
    """The family whose model a config.json (as a dict) describes, by its `model_type`, or None."""
    return next((spec for spec in MODEL_FAMILIES.values() if hf.get("model_type") in spec.model_types), None)
