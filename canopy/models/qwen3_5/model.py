"""The Qwen3.5 policy (Table A3's Qwen3.5-9B): TorchTitan's `Qwen35Model` built from an HF Qwen3.5 checkpoint,
trained on text only. Weights move through TorchTitan's `Qwen35StateDictAdapter`; the vision tower of a multimodal
checkpoint is not trained and is carried through export unchanged, so the exported checkpoint stays complete.

Qwen3.5 interleaves Gated DeltaNet (linear attention) layers with full-attention ones. TorchTitan runs Gated
DeltaNet with flash-linear-attention's Triton kernels, on GPUs only: there the policy passes each row as one
document (TorchTitan folds the batch into one stream and restarts the state at document offsets). Elsewhere each
Gated DeltaNet layer runs the pure-torch kernels of `canopy.models.qwen3_5.gated_delta`, row by row.
"""

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common import Embedding
from torchtitan.models.common.attention import ScaledDotProductAttention, create_varlen_metadata_for_document
from torchtitan.models.common.config_utils import make_ffn_config
from torchtitan.models.qwen3_5 import (
    _EMBEDDING_INIT,
    _LINEAR_INIT,
    _depth_init,
    _offset_norm,
    _output_linear_init,
    _qwen35_attention_config,
    _qwen35_deltanet_config,
    _qwen35_vision_encoder_config,
)
from torchtitan.models.qwen3_5.model import GatedDeltaNet, Qwen35Model, Qwen35TransformerBlock
from torchtitan.models.qwen3_5.rope import MRoPE
from torchtitan.models.qwen3_5.state_dict_adapter import Qwen35StateDictAdapter

from canopy.errors import ConfigError
from canopy.models.logprob_head import LogprobHead
from canopy.models.qwen3_5.gated_delta import causal_conv1d, chunk_gated_delta_rule

TEXT_PREFIX = "model.language_model."  # where the adapter expects the language model's tensors
CARRIED_THROUGH = ("model.visual.", "mtp.")  # checkpoint tensors the policy does not train: exported unchanged


def layer_group(name: str) -> str | None:
    """`layers.<i>.` for a decoder layer's tensor (under any prefix), else None: the adapter converts a layer's
    tensors together (it fuses q / k / v and their convolutions)."""
    match = re.search(r"layers\.\d+\.", name)
    return match.group(0) if match else None


def text_config(hf: dict) -> dict:
    """The language model's config: nested under `text_config` in a multimodal checkpoint."""
    return hf.get("text_config") or hf


def qwen3_5_config_from_hf(hf: dict, max_seq_len: int | None = None) -> Qwen35Model.Config:
    """Translate an HF Qwen3.5 config into TorchTitan's `Qwen35Model.Config`: one block per HF `layer_types`
    entry (full attention with output gate and partial RoPE, or Gated DeltaNet), SDPA for full attention, and a
    vision encoder reduced to nothing (TorchTitan requires one; the policy trains text only)."""
    t = text_config(hf)
    rope_parameters = t.get("rope_parameters") or {}
    if rope_parameters.get("rope_type", "default") != "default":
        raise ConfigError(
            "YaRN rope scaling is applied by the inference engine at test time; train from a checkpoint without it"
        )
    if t.get("num_experts"):
        raise ConfigError("Qwen3.5 MoE checkpoints are not supported yet: use a dense Qwen3.5 (e.g. Qwen3.5-9B)")
    dim, vocab, head_dim = t["hidden_size"], t["vocab_size"], t.get("head_dim", 256)
    rotary_dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 0.25))
    rope = MRoPE.Config(
        dim=rotary_dim,
        max_seq_len=max_seq_len or t.get("max_position_embeddings", 262144),
        theta=float(rope_parameters.get("rope_theta", 10_000_000.0)),
        mrope_section=list(rope_parameters.get("mrope_section", [11, 11, 10])),
    )
    layers = []
    for layer_id, kind in enumerate(t["layer_types"]):
        attention = delta_net = None
        if kind == "full_attention":
            attention = _qwen35_attention_config(
                dim=dim,
                n_heads=t["num_attention_heads"],
                n_kv_heads=t["num_key_value_heads"],
                head_dim=head_dim,
                rotary_dim=rotary_dim,
                rope=rope,
                attn_backend="flex",  # replaced by SDPA below
                layer_id=layer_id,
            )
            attention.inner_attention = ScaledDotProductAttention.Config()
        elif kind == "linear_attention":
            delta_net = _qwen35_deltanet_config(
                dim=dim,
                n_key_heads=t["linear_num_key_heads"],
                n_value_heads=t["linear_num_value_heads"],
                key_head_dim=t["linear_key_head_dim"],
                value_head_dim=t["linear_value_head_dim"],
                layer_id=layer_id,
                conv_kernel_size=t.get("linear_conv_kernel_dim", 4),
            )
        else:
            raise ConfigError(f"Qwen3.5 layer type {kind!r} is unknown: expected full_attention or linear_attention")
        layers.append(
            Qwen35TransformerBlock.Config(
                attention=attention,
                delta_net=delta_net,
                feed_forward=make_ffn_config(
                    dim=dim,
                    hidden_dim=t["intermediate_size"],
                    w1_param_init=_LINEAR_INIT,
                    w2w3_param_init=_depth_init(layer_id),
                ),
                attention_norm=_offset_norm(dim),
                ffn_norm=_offset_norm(dim),
            )
        )
    return Qwen35Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_offset_norm(dim),
        enable_weight_tying=bool(t.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=LogprobHead.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
        vision_encoder=_qwen35_vision_encoder_config(
            dim=8,
            ffn_dim=8,
            num_layers=0,
            num_heads=1,
            patch_size=1,
            temporal_patch_size=1,
            spatial_merge_size=1,
            out_hidden_size=dim,
            num_position_embeddings=1,
        ),
    )


class PortableGatedDeltaNet(GatedDeltaNet):
    """TorchTitan's Gated DeltaNet layer, same parameters: on CUDA its own forward (fla's kernels), elsewhere the
    pure-torch kernels, every row one sequence whose convolution and recurrent state start fresh."""

    def forward(self, x_BLD: torch.Tensor, attention_masks=None) -> torch.Tensor:
        if x_BLD.is_cuda:
            return super().forward(x_BLD, attention_masks)
        B, L, _ = x_BLD.shape

        def heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
            return t.reshape(B, L, -1, head_dim)

        q = heads(causal_conv1d(self.in_proj_q(x_BLD), self.conv_q.weight), self.key_head_dim)
        k = heads(causal_conv1d(self.in_proj_k(x_BLD), self.conv_k.weight), self.key_head_dim)
        v = heads(causal_conv1d(self.in_proj_v(x_BLD), self.conv_v.weight), self.value_head_dim)
        z = heads(self.in_proj_z(x_BLD), self.value_head_dim)
        decay = -torch.exp(self.A_log.float()) * F.softplus(self.in_proj_a(x_BLD).float() + self.dt_bias)
        beta = torch.sigmoid(self.in_proj_b(x_BLD))
        out, _ = chunk_gated_delta_rule(q, k, v, decay, beta)
        return self.out_proj(self.norm(out, z).reshape(B, L, -1))


class Qwen35TextPolicy(Qwen35Model):
    """`Qwen35Model` with the trainer's calling convention, `model(tokens, positions) -> logits`, text only."""

    def __init__(self, config: Qwen35Model.Config, image_token_id: int, video_token_id: int):
        super().__init__(config)
        self.vision_encoder = None  # text only: the checkpoint's vision tower stays in the checkpoint
        self.special_tokens = {"image_id": image_token_id, "video_id": video_token_id}

    def portable(self) -> "Qwen35TextPolicy":
        """Let every Gated DeltaNet layer run where fla's Triton kernels cannot (`PortableGatedDeltaNet`)."""
        for module in self.modules():
            if type(module) is GatedDeltaNet:
                module.__class__ = PortableGatedDeltaNet
        return self

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V]; every row is one sequence starting at position 0 (as the trainer's rows are)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        masks = None
        if tokens.is_cuda:  # fla's kernels see the batch as one stream: each row is a document of its own
            masks = {
                "quadratic_attention": None,  # SDPA, causal within each row
                "deltanet": create_varlen_metadata_for_document(positions, include_host_offsets=True),
            }
        return super().forward(tokens, attention_masks=masks, positions=positions, special_tokens=self.special_tokens)


class Qwen35Checkpoint:
    """Moves weights between an HF Qwen3.5 checkpoint directory and the policy, through TorchTitan's adapter.

    The adapter reads the multimodal layout (`model.language_model.*`); a text-only checkpoint (`model.*`) is
    renamed on the way in and back on the way out. Tensors the policy does not train (`model.visual.*`, `mtp.*`)
    are read from the base checkpoint at export and written back unchanged."""

    def __init__(self, config: Qwen35Model.Config, path: str | Path, multimodal: bool):
        self.adapter = Qwen35StateDictAdapter(config, None)
        self.path, self.multimodal = Path(path), multimodal

    def to_adapter_names(self, hf_name: str) -> str | None:
        """The adapter's name for a checkpoint tensor the policy trains, or None for one it carries through."""
        if hf_name.startswith(CARRIED_THROUGH):
            return None
        return hf_name if self.multimodal or not hf_name.startswith("model.") else TEXT_PREFIX + hf_name[6:]

    def from_adapter_names(self, name: str) -> str:
        return name if self.multimodal or not name.startswith(TEXT_PREFIX) else "model." + name[len(TEXT_PREFIX) :]

    def from_hf(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        renamed = {self.to_adapter_names(k): v for k, v in hf_state.items()}
        return self.adapter.from_hf({k: v for k, v in renamed.items() if k is not None})

    def load_sharded(self, model: torch.nn.Module, path: str | Path) -> None:
        """Stream the checkpoint into a sharded policy one decoder layer at a time (the adapter fuses a layer's
        tensors), never holding the whole model; every parameter must be covered."""
        from safetensors import safe_open
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        groups: dict[str | None, dict[str, tuple[Path, str]]] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                for hf_name in f.keys():
                    name = self.to_adapter_names(hf_name)
                    if name is not None:
                        groups.setdefault(layer_group(name), {})[name] = (file, hf_name)
        rest = groups.pop(None)
        embedding_name = next(n for n in rest if n.endswith("embed_tokens.weight"))
        embedding = _read(*rest[embedding_name])  # read once: every group needs it beside its own tensors
        expected, loaded = set(model.state_dict()), set()
        options = StateDictOptions(full_state_dict=True, strict=False)
        for group in [rest, *groups.values()]:
            # the adapter wants the embedding beside any group (it may copy it into a missing lm_head)
            tensors = {name: _read(*where) for name, where in group.items() if name != embedding_name}
            converted = self.adapter.from_hf({**tensors, embedding_name: embedding})
            if group is not rest:
                converted = {k: v for k, v in converted.items() if k.startswith("layers.")}
            set_model_state_dict(model, converted, options=options)
            loaded |= set(converted)
        missing = expected - loaded
        if missing:
            raise ConfigError(f"checkpoint at '{path}' lacks {sorted(missing)[:3]}...: it does not match config.json")

    def iter_hf_weights(self, model: torch.nn.Module, unwrap):
        """(HF name, full tensor) pairs, one decoder layer at a time (the adapter fuses a layer's q / k / v and
        their convolutions), then the tensors carried through from the base checkpoint."""
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for name, value in model.state_dict().items():
            groups.setdefault(layer_group(name) or name, {})[name] = value
        for group in groups.values():
            gathered = {name: unwrap(value.detach()) for name, value in group.items()}
            for name, tensor in self.adapter.to_hf(gathered).items():
                if not name.startswith(CARRIED_THROUGH):
                    yield self.from_adapter_names(name), tensor
        yield from carried_through(self.path)


def _read(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        return f.get_tensor(name)


def carried_through(path: Path):
    """The checkpoint's tensors the policy does not train (vision tower, multi-token prediction), unchanged."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if name.startswith(CARRIED_THROUGH):
                    yield name, f.get_tensor(name)


def build_text_policy(hf: dict):
    """(config, text policy on the meta device) of config.json `hf`, to be materialized (or sharded first)."""
    config = qwen3_5_config_from_hf(hf)
    t = text_config(hf)
    with torch.device("meta"):
        model = Qwen35TextPolicy(
            config,
            image_token_id=hf.get("image_token_id", t.get("image_token_id", -1)),
            video_token_id=hf.get("video_token_id", t.get("video_token_id", -1)),
        ).portable()
    set_spmd_backend("partial_dtensor")  # the attention-mask dict is plain tensors, not SPMD-typed inputs
    return config, model
