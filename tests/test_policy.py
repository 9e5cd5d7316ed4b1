import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from canopy.errors import ConfigError
from canopy.models.hf_checkpoint import write_hf_checkpoint
from canopy.modules.policy import export_hf_state_dict, iter_hf_weights, load_policy, read_hf_config


def test_torchtitan_policy_matches_hf_exactly(tiny_path):
    model, _ = load_policy(tiny_path)
    hf = Qwen3ForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), hf(tokens).logits)


def test_hf_round_trip_is_exact(tiny_path, tmp_path, tokenizer):
    """Streamed into shards of about 20 kB (the tiny model spans several) and loaded back, by Canopy and by HF."""
    model, adapter = load_policy(tiny_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # a "trained" policy
    out = write_hf_checkpoint(iter_hf_weights(model, adapter), tiny_path, tmp_path / "exported", shard_bytes=20_000)
    assert len(list(out.glob("model-*.safetensors"))) > 2
    reloaded, _ = load_policy(out)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    hf = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    exported = export_hf_state_dict(model, adapter)
    assert set(exported) == set(hf.state_dict())
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()
    assert not list(tmp_path.glob(".exported-*"))  # no staging directory left behind


def test_missing_or_wrong_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="model_type=.llama.; Canopy trains qwen3, qwen3_5, qwen3_5_text"):
        read_hf_config(tmp_path)
