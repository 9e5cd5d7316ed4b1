"""The model families Canopy trains, each a folder `canopy/models/<family>/` exposing its `SPEC` (`ModelSpec`, in
canopy/models/spec.py); this registry is the one place that lists them (docs/model_families.md). Model code imports
nothing of Canopy's trainer, engines or environments (the tiny model builder, tiny.py, excepted: its warm-up plays the
vault world)."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from canopy.errors import ConfigError, require
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


@dataclass
class ModelSettings:
    """`model.*`: the schema (conf/train.yaml holds the defaults and says what each key means)."""

    path: str | None
    name: str | None
    tiny: dict[str, Any] | None
    family: str
    chat_template_kwargs: dict[str, Any]

    def validate(self) -> None:
        """The checkpoint exists and holds a model of the declared family."""
        require(
            self.path is not None or bool(self.tiny),
            "model.path is not set: pass model.path=/path/to/hf_checkpoint (config.json + *.safetensors + tokenizer)",
        )
        require(
            self.path is None or Path(self.path).exists(),
            f"model.path '{self.path}' does not exist: point it at an HF checkpoint directory (config.json + "
            "*.safetensors + tokenizer)"
            + (", or leave model.path unset for the embedded tiny model" if self.tiny else ""),
        )
        require(
            self.path is None or Path(self.path).is_dir(),
            f"model.path '{self.path}' is a file: point it at an HF checkpoint directory (config.json + "
            "*.safetensors + tokenizer)",
        )
        require(
            self.path is None or (Path(self.path) / "config.json").is_file(),
            f"model.path '{self.path}' has no config.json: point it at an HF checkpoint directory (config.json + "
            "*.safetensors + tokenizer)",
        )
        require(
            self.family in MODEL_FAMILIES,
            f"model.family={self.family!r} has no model in this build yet: use one of {', '.join(MODEL_FAMILIES)}",
        )
        if self.path is not None:
            hf = json.loads((Path(self.path) / "config.json").read_text())
            family = family_of(hf)
            found = family.name if family is not None else None
            require(
                found == self.family,
                f"model.family={self.family} but model.path '{self.path}' holds model_type={hf.get('model_type')!r}"
                + (f": set model.family={found}" if found else f": Canopy trains {', '.join(MODEL_FAMILIES)}"),
            )
