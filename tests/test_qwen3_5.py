"""The Qwen3.5 policy (canopy/models/qwen3_5/model.py) on a tiny random checkpoint built here: logits equal HF
`Qwen3_5ForCausalLM`'s, the HF -> policy -> HF round trip is exact, a multimodal checkpoint's vision tower is carried
through export unchanged, and a training step moves the loss."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM

from canopy.models.qwen3_5.gated_delta import transformers_on_torch_kernels
from canopy.modules.policy import export_hf_state_dict, load_policy, read_hf_weights
from canopy.tiny_model import build_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3_5_path(tmp_path_factory):
    """A tiny text-only Qwen3.5 (3 Gated DeltaNet layers, then full attention, then one more DeltaNet layer),
    every tensor perturbed: HF initializes its norms to constants, which would hide a misplaced norm."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("q35") / "tiny", family="qwen3_5", layers=5, seed=0)
    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    weights = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_logits_match_hf_qwen3_5(qwen3_5_path):
    transformers_on_torch_kernels()
    layer_types = json.loads((qwen3_5_path / "config.json").read_text())["layer_types"]
    assert layer_types == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    policy, _ = load_policy(qwen3_5_path)
    hf = Qwen3_5ForCausalLM.from_pretrained(qwen3_5_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 40, (3, 70), generator=torch.Generator().manual_seed(0))  # past one 64-token chunk
    with torch.no_grad():
        ours, theirs = policy(ids), hf(input_ids=ids).logits
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert torch.allclose(ours, theirs, atol=2e-5, rtol=1e-5), (ours - theirs).abs().max()
    with torch.no_grad():  # rows are independent sequences: no state leaks from one row into the next
        assert torch.allclose(policy(ids[1:2]), ours[1:2], atol=1e-6)


def test_round_trip_is_exact(qwen3_5_path):
    policy, adapter = load_policy(qwen3_5_path)
    exported, original = export_hf_state_dict(policy, adapter), read_hf_weights(qwen3_5_path)
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_multimodal_checkpoint_keeps_its_vision_tower(qwen3_5_path, tmp_path):
    """A multimodal checkpoint (language model under `model.language_model.`, a vision tower under `model.visual.`):
    the policy trains the language model and exports the vision tensors untouched, in the checkpoint's layout."""
    path = tmp_path / "multimodal"
    shutil.copytree(qwen3_5_path, path)
    text = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in read_hf_weights(path).items()}
    vision = {"model.visual.blocks.0.attn.qkv.weight": torch.randn(24, 8), "mtp.fc.weight": torch.randn(4, 4)}
    save_file({**weights, **vision}, path / "model.safetensors", metadata={"format": "pt"})
    policy, adapter = load_policy(path)
    assert not any("visual" in name for name in policy.state_dict())  # the policy holds the language model only
    exported = export_hf_state_dict(policy, adapter)
    assert exported.keys() == weights.keys() | vision.keys()
    for name, tensor in {**weights, **vision}.items():
        assert torch.equal(exported[name], tensor), name


def test_a_training_step_lowers_the_loss(qwen3_5_path):
    policy, _ = load_policy(qwen3_5_path)
    ids = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.05)

    def loss():
        logits = policy(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    before = loss()
    before.backward()
    deltanet = policy.layers["0"].attn
    assert deltanet.A_log.grad.abs().sum() > 0 and deltanet.conv_q.weight.grad.abs().sum() > 0
    optimizer.step()
    with torch.no_grad():
        assert loss() < before.detach()


def test_local_engine_samples_qwen3_5_with_the_trainers_logprobs(qwen3_5_path):
    """Left-padded, cached generation (KV cache for full attention, recurrent and conv state for Gated DeltaNet)
    scores its tokens as the trainer's full forward does, before and after a weight sync."""
    from transformers import AutoTokenizer

    from canopy.rollout.engine import SamplingParams
    from canopy.rollout.local import LocalEngine

    tokenizer = AutoTokenizer.from_pretrained(qwen3_5_path)
    engine = LocalEngine(qwen3_5_path, [tokenizer.convert_tokens_to_ids("<|im_end|>")], tokenizer.pad_token_id, seed=3)
    policy, adapter = load_policy(qwen3_5_path)
    prompts = [tokenizer.encode("task : vault 1 . status : guest", add_special_tokens=False), [5, 6]]

    def check(generations):
        for prompt, generation in zip(prompts, generations):
            ids = torch.tensor([prompt + generation.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(policy(ids)[0, :-1] / 0.7, -1)
            expected = logp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
            assert len(generation.token_ids) > 3
            assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4)

    check(engine.generate(prompts, [12, 12], SamplingParams(temperature=0.7, top_p=1.0, top_k=-1)))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.05)
    engine.update_weights(export_hf_state_dict(policy, adapter).items(), version=1)
    check(engine.generate(prompts, [12, 12], SamplingParams(temperature=0.7, top_p=1.0, top_k=-1)))


def test_tensor_parallel_qwen3_5_on_cpu_is_refused_in_one_line(qwen3_5_path):
    from canopy.errors import ConfigError
    from canopy.modules.parallel import ParallelSettings, build_parallel_policy

    with pytest.raises(ConfigError, match="use parallelism.dp_shard \\(FSDP\\), or GPUs"):
        build_parallel_policy(qwen3_5_path, ParallelSettings(tp=2), 2, torch.device("cpu"))


def test_context_parallel_qwen3_5_is_refused_at_start_even_on_gpus(qwen3_5_path):
    """TorchTitan's Qwen3.5 has no context parallel (ModelSpec.context_parallel): refused before any GPU is used."""
    from canopy.errors import ConfigError
    from canopy.modules.parallel import ParallelSettings, build_parallel_policy

    with pytest.raises(ConfigError, match="parallelism.cp=2 with model.family=qwen3_5: .* with parallelism.tp"):
        build_parallel_policy(qwen3_5_path, ParallelSettings(cp=2), 2, torch.device("cuda"))
