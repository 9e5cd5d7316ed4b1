"""Qwen3 (dense): TorchTitan's `Qwen3Model`, weights through its `Qwen3StateDictAdapter` one tensor at a time,
sharded by its `parallelize_qwen3` (FSDP2 x TP x CP). Its TorchTitan modules are imported on first use."""

from pathlib import Path

import torch

from canopy.models.spec import ChatMarkers, ModelSpec, PerTensorCheckpoint

# Qwen's chat format: <|im_start|>{role}\n{content}<|im_end|>\n
CHAT = ChatMarkers(turn_start="<|im_start|>", turn_end="<|im_end|>", stop=("<|im_end|>", "<|endoftext|>"))


def build(hf: dict, parallel=None):
    from canopy.models.qwen3.model import qwen3_config_from_hf

    config = qwen3_config_from_hf(hf)
    if parallel is not None:
        config.update_from_config(config=parallel)
    with torch.device("meta"):
        model = config.build()
    return config, model


def checkpoint(config, hf: dict, path: str | Path) -> PerTensorCheckpoint:
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    # the adapter reads the path only for a sharded checkpoint's index; a single-file checkpoint needs none
    sharded = (Path(path) / "model.safetensors.index.json").is_file()
    return PerTensorCheckpoint(Qwen3StateDictAdapter(config, str(path) if sharded else None))


def parallelize(model: torch.nn.Module, **kwargs):
    from torchtitan.models.qwen3 import parallelize_qwen3

    return parallelize_qwen3(model, **kwargs)


def tiny_model(shared: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**shared))


SPEC = ModelSpec(
    name="qwen3",
    model_types=("qwen3",),
    build=build,
    checkpoint=checkpoint,
    parallelize=parallelize,
    tiny_model=tiny_model,
    chat=CHAT,
)
