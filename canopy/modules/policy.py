"""The policy: a TorchTitan model built from an HF-format checkpoint directory, by model family (`model_type` in
its config.json): Qwen3 here, Qwen3.5 in `canopy.modules.qwen3_5`.

Model definitions come from TorchTitan; weights move in and out through TorchTitan's own state-dict adapters
(HF safetensors <-> TorchTitan names), so an exported policy loads in HF transformers and SGLang unchanged.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from torchtitan.models.common import CosSinRoPE, Embedding
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from canopy.errors import ConfigError
from canopy.modules.logprob_head import LogprobHead

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
        lm_head=LogprobHead.Config(in_features=dim, out_features=vocab, param_init=_INIT),
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


def build_model(hf: dict, device: str = "cpu") -> torch.nn.Module:
    """The TorchTitan model of config.json `hf`'s family with its buffers (RoPE) initialized and its parameters
    left to be loaded: allocated on `device`, or no memory at all on "meta"."""
    if model_family(hf) == "qwen3_5":
        from canopy.modules.qwen3_5 import build_qwen3_5

        _, model, _ = build_qwen3_5("", hf, meta=True)  # no checkpoint: its weight mover is never used
    else:
        with torch.device("meta"):
            model = qwen3_config_from_hf(hf).build()
    model.to_empty(device=device)
    model.init_states(buffer_device=torch.device(device))
    return model


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32):
    """Build the TorchTitan model of `path`'s family and load its HF weights exactly (strict); returns the model
    and the adapter that exports it."""
    hf = read_hf_config(path)
    if model_family(hf) == "qwen3_5":
        from canopy.modules.qwen3_5 import load_qwen3_5

        return load_qwen3_5(path, hf, read_hf_weights(path), dtype)
    model = build_model(hf)  # parameters are overwritten below
    # the adapter reads the path only for a sharded checkpoint's index; a single-file checkpoint needs none
    sharded = (Path(path) / "model.safetensors.index.json").is_file()
    adapter = Qwen3StateDictAdapter(model.config, str(path) if sharded else None)
    model.load_state_dict(adapter.from_hf(read_hf_weights(path)), strict=True)
    return model.to(dtype), adapter


def unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: DTensors are gathered (a collective: every rank must call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def iter_hf_weights(model: torch.nn.Module, adapter, gather=unwrap):
    """(HF name, full tensor) pairs, one tensor at a time: a sharded policy is never gathered whole anywhere.
    `gather` makes each parameter whole (`unwrap`: on every rank; `parallel.gather_on_rank0`: on rank 0 only, the
    other ranks walking meta tensors). A collective when sharded: every rank must walk it to the end."""
    if hasattr(adapter, "iter_hf_weights"):  # a family whose adapter converts several tensors together
        yield from adapter.iter_hf_weights(model, gather)
        return
    for name, value in model.state_dict().items():
        yield from adapter.to_hf({name: gather(value.detach())}).items()


def export_hf_state_dict(model: torch.nn.Module, adapter: Qwen3StateDictAdapter) -> dict[str, torch.Tensor]:
    """The policy's weights under HF names, as the engines load them (a collective when sharded)."""
    return dict(iter_hf_weights(model, adapter))


def write_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    base_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    shard_bytes: int = 4 << 30,
) -> Path:
    """Stream (HF name, tensor) pairs into an HF checkpoint directory: safetensors shards of about `shard_bytes`
    written as the tensors come (never the whole model in memory) + their index + the base checkpoint's other
    files (config, tokenizer). Staged next to `out_dir` and renamed into place: never half-written."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        weight_map, shard, size, total = {}, {}, 0, 0
        for name, tensor in named_tensors:
            shard[name] = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
            size += shard[name].nbytes
            if size >= shard_bytes:
                total += _save_shard(staging, shard, weight_map)
                shard, size = {}, 0
        if shard or not weight_map:
            total += _save_shard(staging, shard, weight_map)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        for file in Path(base_path).iterdir():
            if file.is_file() and not any(file.match(pattern) for pattern in WEIGHT_FILES):
                shutil.copy2(file, staging / file.name)
        if out_dir.exists():  # a resumed run re-writes the version it stopped at
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
        return out_dir
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json")  # not copied from the base checkpoint


def _save_shard(directory: Path, shard: dict[str, torch.Tensor], weight_map: dict[str, str]) -> int:
    name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save_file(shard, directory / name, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, name))
    return sum(t.nbytes for t in shard.values())
