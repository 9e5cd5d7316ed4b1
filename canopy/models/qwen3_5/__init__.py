"""Qwen3.5 (dense, text): TorchTitan's `Qwen35Model` (Gated DeltaNet + full attention) as a text policy
(`model.py`), weights through its `Qwen35StateDictAdapter` one decoder layer at a time (vision / MTP tensors carried
through), sharded by its `parallelize_qwen3_5`; pure-torch Gated DeltaNet kernels for CPU (`gated_delta.py`). Its
TorchTitan modules are imported on first use."""

from pathlib import Path

import torch

from canopy.models.qwen3 import CHAT
from canopy.models.spec import ModelSpec


def build(hf: dict, parallel=None):
    from canopy.models.qwen3_5.model import build_text_policy

    config, model = build_text_policy(hf)
    if parallel is not None:
        config.update_from_config(config=parallel)
    return config, model


def checkpoint(config, hf: dict, path: str | Path):
    from canopy.models.qwen3_5.model import Qwen35Checkpoint

    return Qwen35Checkpoint(config, path, multimodal="text_config" in hf)


def parallelize(model: torch.nn.Module, **kwargs):
    from torchtitan.models.qwen3_5 import parallelize_qwen3_5

    return parallelize_qwen3_5(model, **kwargs)


def hf_on_cpu() -> None:
    from canopy.models.qwen3_5.gated_delta import transformers_on_torch_kernels

    transformers_on_torch_kernels()  # fla's Triton kernels cannot run on the CPU


def tiny_model(shared: dict):
    """Full attention on every 4th layer (and on the last, for fewer than 4), Gated DeltaNet on the others, as
    Qwen3.5 does."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_on_cpu()
    layers, hidden_size = shared["num_hidden_layers"], shared["hidden_size"]
    full = [(i + 1) % 4 == 0 or (layers < 4 and i == layers - 1) for i in range(layers)]
    config = Qwen3_5TextConfig(
        **shared,
        layer_types=["full_attention" if f else "linear_attention" for f in full],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=hidden_size // 4,
        linear_value_head_dim=hidden_size // 4,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    return Qwen3_5ForCausalLM(config)


SPEC = ModelSpec(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_text"),
    build=build,
    checkpoint=checkpoint,
    parallelize=parallelize,
    tiny_model=tiny_model,
    chat=CHAT,  # Qwen's chat format, as Qwen3's
    hf_on_cpu=hf_on_cpu,
    cpu_tp_cp_refusal=(
        "parallelism.tp / cp > 1 with Qwen3.5 on CPU: its torch Gated DeltaNet kernels run unsharded; use "
        "parallelism.dp_shard (FSDP), or GPUs"
    ),
    context_parallel=False,  # TorchTitan's Qwen3.5 has no CP: SWE-bench's long rows are split by TP (docs/memory.md)
    gated_delta_rule="canopy.models.qwen3_5.model.chunk_gated_delta_rule",
)
