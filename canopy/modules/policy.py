"""The policy: a TorchTitan model built from an HF-format checkpoint directory, by model family (`model_type` in
its config.json): Qwen3 here, Qwen3.5 in `canopy.modules.qwen3_5`.

Model definitions come from TorchTitan; weights move in and out through TorchTitan's own state-dict adapters
(HF safetensors <-> TorchTitan names), so an exported policy loads in HF transformers and SGLang unchanged.
"""

import json
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from canopy.config import ConfigError

_INIT = {"weight": partial(torch.nn.init.normal_, std=0.02), "bias": torch.nn.init.zeros_}


MODEL_FAMILIES = {"qwen3": ("qwen3",), "qwen3_5": ("qwen3_5", "qwen3_5_text")}  # model.family: its model_types


def read_hf_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"model.path '{path}' is not an HF checkpoint directory (no config.json): "
            "point model.path at a directory with config.json, *.safetensors and the tokenizer"
        )
    hf = json.loads(config_file.read_text())
    if model_family(hf) is None:
        known = ", ".join(t for types in MODEL_FAMILIES.values() for t in types)
        raise ConfigError(f"model.path '{path}' holds model_type={hf.get('model_type')!r}; Canopy trains {known}")
    return hf


def model_family(hf: dict) -> str | None:
    """The family whose model a config.json describes, or None."""
    return next((family for family, types in MODEL_FAMILIES.items() if hf.get("model_type") in types), None)


def qwen3_config_from_hf(hf: dict, max_seq_len: int | None = None) -> Qwen3Model.Config:
    """Translate an HF `Qwen3Config` dict into TorchTitan's `Qwen3Model.Config` (SDPA attention, causal)."""
    rope_parameters = hf.get("rope_parameters") or {}  # transformers 5 layout; 4.x keeps rope_theta/rope_scaling
    if hf.get("rope_scaling") or rope_parameters.get("rope_type", "default") != "default":
        raise ConfigError(
            "YaRN rope scaling is applied by the inference engine at test time; train from a checkpoint without it"
        )
    if hf.get("use_sliding_window"):
        raise ConfigError("sliding-window attention is not supported: set use_sliding_window=false in config.json")
    dim, vocab = hf["hidden_size"], hf["vocab_size"]
    head_dim = hf.get("head_dim") or dim // hf["num_attention_heads"]
    eps = hf.get("rms_norm_eps", 1e-6)
    norm = partial(RMSNorm.Config, eps=eps, param_init={"weight": torch.nn.init.ones_})
    rope = CosSinRoPE.Config(
        dim=head_dim,
        max_seq_len=max_seq_len or hf.get("max_position_embeddings", 40960),
        theta=float(rope_parameters.get("rope_theta", hf.get("rope_theta", 10_000.0))),
    )
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(normalized_shape=dim),
            ffn_norm=norm(normalized_shape=dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=hf["num_attention_heads"],
                n_kv_heads=hf.get("num_key_value_heads"),
                head_dim=head_dim,
                wqkv_param_init=_INIT,
                wo_param_init=_INIT,
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=False,
                rope=rope,
                qk_norm=norm(normalized_shape=head_dim),
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=hf["intermediate_size"], w1_param_init=_INIT, w2w3_param_init=_INIT
            ),
        )
        for _ in range(hf["num_hidden_layers"])
    ]
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm(normalized_shape=dim),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_INIT),
        layers=layers,
    )


def safetensors_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path '{path}' has no *.safetensors weights: export or download the checkpoint there")
    return files


def read_hf_weights(path: str | Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in safetensors_files(path):
        state.update(load_file(file))
    return state


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32):
    """Build the TorchTitan model of `path`'s family and load its HF weights exactly (strict); returns the model
    and the adapter that exports it."""
    hf = read_hf_config(path)
    if model_family(hf) == "qwen3_5":
        from canopy.modules.qwen3_5 import load_qwen3_5

        return load_qwen3_5(path, hf, read_hf_weights(path), dtype)
    config = qwen3_config_from_hf(hf)
    # the adapter reads the path only for a sharded checkpoint's index; a single-file checkpoint needs none
    sharded = (Path(path) / "model.safetensors.index.json").is_file()
    adapter = Qwen3StateDictAdapter(config, str(path) if sharded else None)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))  # RoPE cache; parameters are overwritten below
    model.load_state_dict(adapter.from_hf(read_hf_weights(path)), strict=True)
    return model.to(dtype), adapter


def unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: DTensors are gathered (a collective: every rank must call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def iter_hf_weights(model: torch.nn.Module, adapter):
    """(HF name, full tensor) pairs, one tensor at a time: a sharded policy is never gathered whole anywhere.
    A collective when sharded: every rank must walk it to the end."""
    if hasattr(adapter, "iter_hf_weights"):  # a family whose adapter converts several tensors together
        yield from adapter.iter_hf_weights(model, unwrap)
        return
    for name, value in model.state_dict().items():
        for hf_name, tensor in adapter.to_hf({name: value}).items():
            yield hf_name, unwrap(tensor.detach())


def export_hf_state_dict(model: torch.nn.Module, adapter: Qwen3StateDictAdapter) -> dict[str, torch.Tensor]:
    """The policy's weights under HF names, as the engines load them (a collective when sharded)."""
    return dict(iter_hf_weights(model, adapter))


def save_hf_checkpoint(hf_state_dict: dict, tokenizer, base_path: str | Path, out_dir: str | Path) -> Path:
    """Write HF-named weights as a checkpoint directory (base config + safetensors + tokenizer), atomically."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    state = {k: v.contiguous() for k, v in hf_state_dict.items()}
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(Path(base_path) / "config.json", staging / "config.json")
    tokenizer.save_pretrained(staging)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    return out_dir
