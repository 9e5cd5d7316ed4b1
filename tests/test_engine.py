import pytest
import torch

from canopy.modules.policy import export_hf_state_dict, load_policy
from canopy.rollout.engine import SamplingParams
from canopy.rollout.local import LocalEngine, filter_logits
from canopy.rollout.settings import LocalEngineSettings
from tests.helpers import UNFILTERED


def engine_for(tiny_path, tokenizer, seed=0):
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    return LocalEngine(tiny_path, stop, tokenizer.pad_token_id, seed=seed)


def test_generation_respects_limits_stops_and_reports_logprobs(tiny_path, tokenizer):
    engine = engine_for(tiny_path, tokenizer)
    prompts = [
        tokenizer.encode("task : vault 1", add_special_tokens=False),
        tokenizer.encode("goal", add_special_tokens=False),
    ]
    out = engine.generate(prompts, [5, 40], SamplingParams(temperature=0.9, top_p=1.0, top_k=-1))
    assert len(out[0].token_ids) <= 5 and len(out[1].token_ids) <= 40
    for generation, limit in zip(out, [5, 40]):
        assert len(generation.logprobs) == len(generation.token_ids) and generation.weight_version == 0
        stopped = generation.token_ids[-1] in engine.stop_token_ids.tolist()
        assert generation.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(generation.token_ids) == limit
        assert not any(t in engine.stop_token_ids.tolist() for t in generation.token_ids[:-1])


def test_engine_logprobs_equal_the_policy_logprobs_at_temperature(tiny_path, tokenizer):
    """Left-padded, KV-cached sampling scores tokens exactly as a full forward of the trainer's model does."""
    engine = engine_for(tiny_path, tokenizer, seed=3)
    policy, _ = load_policy(tiny_path)
    prompts = [tokenizer.encode("task : vault 1 . status : guest", add_special_tokens=False), [5, 6]]
    out = engine.generate(prompts, [12, 12], SamplingParams(temperature=0.7, top_p=1.0, top_k=-1))
    for prompt, generation in zip(prompts, out):
        ids = torch.tensor([prompt + generation.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(policy(ids)[0, :-1] / 0.7, -1)
        expected = logp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4)


def test_weight_sync_changes_outputs_and_version(tiny_path, tokenizer):
    engine = engine_for(tiny_path, tokenizer)
    policy, adapter = load_policy(tiny_path)
    prompt = tokenizer.encode("task : vault 1", add_special_tokens=False)
    greedy = SamplingParams(temperature=1.0, top_p=1.0, top_k=1)
    before = engine.generate([prompt], [8], greedy)[0]
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    engine.update_weights(export_hf_state_dict(policy, adapter).items(), version=7)
    after = engine.generate([prompt], [8], greedy)[0]
    assert after.weight_version == 7 and before.weight_version == 0
    assert after.token_ids != before.token_ids
    ids = torch.tensor([prompt + after.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(policy(ids)[0, :-1], -1)[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None])
    assert torch.allclose(torch.tensor(after.logprobs), logp.squeeze(-1), atol=1e-4)


def test_same_seed_same_samples(tiny_path, tokenizer):
    prompt = [tokenizer.encode("task : vault 1", add_special_tokens=False)] * 3
    a = engine_for(tiny_path, tokenizer, seed=5).generate(prompt, [10] * 3, UNFILTERED)
    b = engine_for(tiny_path, tokenizer, seed=5).generate(prompt, [10] * 3, UNFILTERED)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)[0, 2:]).all()
    assert not torch.isinf(filter_logits(logits, 2, 1.0)[0, :2]).any()
    nucleus = filter_logits(logits, -1, 0.7)  # 0.5 + 0.3 crosses 0.7: keep two
    assert (~torch.isinf(nucleus)).sum().item() == 2
    assert torch.equal(filter_logits(logits, -1, 1.0), logits)


def test_partial_or_foreign_weight_updates_are_refused(tiny_path, tokenizer):
    engine = engine_for(tiny_path, tokenizer)
    policy, adapter = load_policy(tiny_path)
    weights = export_hf_state_dict(policy, adapter)
    partial = [(k, v) for k, v in weights.items() if k != "lm_head.weight"]
    with pytest.raises(RuntimeError, match="missed"):
        engine.update_weights(partial, version=1)
    with pytest.raises(KeyError, match="does not have"):
        engine.update_weights([("model.bogus.weight", torch.zeros(1))], version=1)
    assert engine.weight_version == 0


def test_a_bfloat16_engine_samples_near_the_float32_trainer_but_not_equal(tiny_path, tokenizer):
    """`engine.local.dtype=bfloat16`: the gap the device check measures on a GPU, here on the CPU's bf16 kernels."""
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = LocalEngine(
        tiny_path, stop, tokenizer.pad_token_id, seed=3, settings=LocalEngineSettings(dtype="bfloat16")
    )
    assert engine.dtype == "bfloat16" and next(engine.model.parameters()).dtype == torch.bfloat16
    policy, _ = load_policy(tiny_path)
    prompt = tokenizer.encode("task : vault 1 . status : guest", add_special_tokens=False)
    generation = engine.generate([prompt], [16], SamplingParams(temperature=0.7, top_p=1.0, top_k=-1))[0]
    ids = torch.tensor([prompt + generation.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(policy(ids)[0, :-1] / 0.7, -1)
    expected = logp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
    gap = (torch.tensor(generation.logprobs) - expected).abs().mean().item()
    assert 1e-5 < gap < 0.05, gap  # bf16 rounding: far above float32's ~1e-7, far below a wrong model's


@pytest.mark.parametrize(
    "override,message",
    [
        ("engine.local.dtype=fp8", "engine.local.dtype='fp8' is unknown"),
        ("engine.local.device=tpu", "engine.local.device='tpu' is unknown"),
    ],
)
def test_engine_dtype_and_device_are_validated(override, message):
    from canopy.config import validate
    from canopy.errors import ConfigError
    from canopy.tools.memory_plan import compose_config

    with pytest.raises(ConfigError, match=message):
        validate(compose_config([override]))
