"""The policy: the TorchTitan model of an HF-format checkpoint directory's model family (`model_type` in its
config.json; the families and their specs: `canopy.models`).

Model definitions come from TorchTitan; weights move in and out through each family's `Checkpoint` (TorchTitan's
state-dict adapters: HF safetensors <-> TorchTitan names), so an exported policy loads in HF transformers and SGLang
unchanged.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from canopy.errors import ConfigError
from canopy.models import MODEL_FAMILIES, family_of
from canopy.models.spec import Checkpoint, safetensors_files


def read_hf_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"model.path '{path}' is not an HF checkpoint directory (no config.json): "
            "point model.path at a directory with config.json, *.safetensors and the tokenizer"
        )
    hf = json.loads(config_file.read_text())
    if family_of(hf) is None:
        known = ", ".join(t for spec in MODEL_FAMILIES.values() for t in spec.model_types)
        raise ConfigError(f"model.path '{path}' holds model_type={hf.get('model_type')!r}; Canopy trains {known}")
    return hf


def read_hf_weights(path: str | Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in safetensors_files(path):
        state.update(load_file(file))
    return state


def build_model(hf: dict, device: str = "cpu") -> torch.nn.Module:
    """The TorchTitan model of config.json `hf`'s family with its buffers (RoPE) initialized and its parameters
    left to be loaded: allocated on `device`, or no memory at all on "meta"."""
    _, model = family_of(hf).build(hf)
    model.to_empty(device=device)
    model.init_states(buffer_device=torch.device(device))
    return model


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Checkpoint]:
    """Build the TorchTitan model of `path`'s family and load its HF weights exactly (strict); returns the model
    and the family's `Checkpoint` that exports it."""
    hf = read_hf_config(path)
    spec = family_of(hf)
    config, model = spec.build(hf)
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))  # RoPE cache; parameters are loaded below
    checkpoint = spec.checkpoint(config, hf, path)
    model.load_state_dict(checkpoint.from_hf(read_hf_weights(path)), strict=True)
    return model.to(dtype), checkpoint


def unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: DTensors are gathered (a collective: every rank must call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def iter_hf_weights(model: torch.nn.Module, adapter: Checkpoint, gather=unwrap):
    """(HF name, full tensor) pairs, one tensor at a time: a sharded policy is never gathered whole anywhere.
    `gather` makes each parameter whole (`unwrap`: on every rank; `parallel.gather_on_rank0`: on rank 0 only, the
    other ranks walking meta tensors). A collective when sharded: every rank must walk it to the end."""
    yield from adapter.iter_hf_weights(model, gather)


def export_hf_state_dict(model: torch.nn.Module, adapter: Checkpoint) -> dict[str, torch.Tensor]:
    """The policy's weights under HF names, as the engines load them (a collective when sharded)."""
    return dict(iter_hf_weights(model, adapter))
