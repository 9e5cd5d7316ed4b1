"""Qwen3's TorchTitan model (`Qwen3Model`, SDPA attention, causal) from an HF `Qwen3Config`."""

from functools import partial

import torch
from torchtitan.models.common import CosSinRoPE, Embedding
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock

from canopy.errors import ConfigError
from canopy.models.logprob_head import LogprobHead

_INIT = {"weight": partial(torch.nn.init.normal_, std=0.02), "bias": torch.nn.init.zeros_}


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
