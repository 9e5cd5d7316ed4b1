"""A model family as one object, after TorchTitan's `ModelSpec`: what the rest of Canopy needs of a family (building
its TorchTitan model from an HF config.json, sharding it, moving its weights in and out of HF checkpoints, its chat
markers, what transformers needs to run it, its tiny checkpoint), so that no code outside `canopy/models/` names a
family. Adding one: docs/model_families.md.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from canopy.errors import ConfigError


@dataclass(frozen=True)
class ChatMarkers:
    """The chat format's special tokens: the agent loop closes and opens turns with them, the engines stop on `stop`."""

    turn_start: str
    turn_end: str
    stop: tuple[str, ...]


class Checkpoint(Protocol):
    """Moves weights between an HF checkpoint directory and the family's TorchTitan model."""

    def from_hf(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's state dict from the checkpoint's tensors (HF names), for a strict `load_state_dict`."""

    def load_sharded(self, model: torch.nn.Module, path: str | Path) -> None:
        """Stream the checkpoint at `path` into a sharded model, never holding it whole; every parameter covered."""

    def iter_hf_weights(self, model: torch.nn.Module, gather) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs, each parameter made whole by `gather` (a collective when sharded)."""


@dataclass(frozen=True)
class ModelSpec:
    """One model family. `build(hf, parallel)`: (TorchTitan config, model on the meta device) from config.json `hf`,
    its config updated with `parallel` (the object TorchTitan's `update_from_config` reads, holding `.parallelism`)
    when given; `checkpoint(config, hf, path)`: the family's `Checkpoint` for `path`; `parallelize`: TorchTitan's
    parallelize function (TP plan, FSDP wrapping units, activation checkpointing); `tiny_model(shared)`: a random HF
    model of the family from the tiny checkpoint's shared config keys (canopy.tiny_model)."""

    name: str  # model.family
    model_types: tuple[str, ...]  # the HF config.json `model_type`s it trains
    build: Callable[..., tuple[Any, torch.nn.Module]]
    checkpoint: Callable[[Any, dict, str | Path], Checkpoint]
    parallelize: Callable[..., Any]
    tiny_model: Callable[[dict], Any]
    chat: ChatMarkers
    hf_on_cpu: Callable[[], None] | None = None  # makes transformers' model of the family run on CPU (local engine)
    cpu_tp_cp_refusal: str | None = None  # why TP / CP > 1 cannot run on CPU (the one-line error); None: they can
    context_parallel: bool = True  # whether its TorchTitan model shards sequences (parallelism.cp > 1)
    gated_delta_rule: str | None = None  # where the model calls its Gated DeltaNet kernel (the memory plan's stand-in)

    def require_context_parallel(self, cp: int) -> None:
        """Refuse `parallelism.cp` > 1 for a family whose TorchTitan model does not shard sequences."""
        if cp > 1 and not self.context_parallel:
            raise ConfigError(
                f"parallelism.cp={cp} with model.family={self.name}: its TorchTitan model has no context parallel; "
                "split long sequences with parallelism.tp instead (docs/memory.md)"
            )


def safetensors_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path '{path}' has no *.safetensors weights: export or download the checkpoint there")
    return files


class PerTensorCheckpoint:
    """The `Checkpoint` of a TorchTitan state-dict adapter that converts each tensor on its own (Qwen3's)."""

    def __init__(self, adapter):
        self.adapter = adapter

    def from_hf(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.adapter.from_hf(hf_state)

    def iter_hf_weights(self, model: torch.nn.Module, gather) -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in model.state_dict().items():
            yield from self.adapter.to_hf({name: gather(value.detach())}).items()

    def load_sharded(self, model: torch.nn.Module, path: str | Path) -> None:
        """Stream the HF safetensors into a sharded model, one tensor at a time; every parameter must be covered."""
        from safetensors import safe_open
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        expected = set(model.state_dict())
        loaded = set()
        tied = bool(getattr(model, "enable_weight_tying", False))
        options = StateDictOptions(full_state_dict=True, strict=False)
        for file in safetensors_files(path):
            with safe_open(file, framework="pt") as weights:
                for hf_name in weights.keys():
                    tensor = weights.get_tensor(hf_name)
                    converted = self.adapter.from_hf(_one_tensor(hf_name, tensor, tied))
                    if tied and hf_name != "model.embed_tokens.weight":
                        converted.pop("lm_head.weight", None)  # a placeholder, see _one_tensor
                    set_model_state_dict(model, converted, options=options)
                    loaded |= set(converted)
        if tied:
            loaded.add("lm_head.weight")
        missing = expected - loaded
        if missing:
            raise ConfigError(
                f"checkpoint at '{path}' lacks {sorted(missing)[:3]}...: it does not match its config.json"
            )


def _one_tensor(hf_name: str, tensor: torch.Tensor, tied: bool) -> dict[str, torch.Tensor]:
    """A one-tensor HF dict the adapter accepts: for tied embeddings it insists on seeing an lm_head entry."""
    return (
        {hf_name: tensor, "lm_head.weight": tensor}
        if tied and hf_name != "model.embed_tokens.weight"
        else {hf_name: tensor}
    )
