"""The local engine's sessions: an episode's cache kept between its turns samples exactly what prefilling its whole
history again samples, for Qwen3 (attention only) and Qwen3.5 (Gated DeltaNet state, continuations of unequal length
prefilled apart), prefills only what each turn adds, and is dropped when its episode ends or the weights change."""

import pytest
import torch

from canopy.envs.embedded import EmbeddedEnvironment
from canopy.modules.policy import export_hf_state_dict, load_policy
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.engine import SamplingParams
from canopy.rollout.local import LocalEngine
from canopy.rollout.settings import LocalEngineSettings
from canopy.tiny_model import build_tiny_checkpoint

SAMPLING = SamplingParams(temperature=0.8, top_p=1.0, top_k=-1)


@pytest.fixture(scope="module")
def qwen3_5_tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("q35") / "tiny", family="qwen3_5", layers=5, seed=0)


@pytest.fixture(params=["qwen3", "qwen3_5"])
def checkpoint(request, tiny_path):
    return tiny_path if request.param == "qwen3" else request.getfixturevalue("qwen3_5_tiny")


def engine(path, tokenizer, session_tokens=131072, seed=3):
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return LocalEngine(
        path, stops, tokenizer.pad_token_id, seed=seed, settings=LocalEngineSettings(session_tokens=session_tokens)
    )


def first_prompts(tokenizer):
    """Two episodes of one task (the same prompt) and one of another."""
    a = tokenizer.encode("task : vault 1 . status : guest", add_special_tokens=False)
    b = tokenizer.encode("goal : open vault", add_special_tokens=False)
    return [a, a, b]


def next_prompts(tokenizer, prompts, generations):
    """Each history extended by its generation and an observation, of a different length for each episode."""
    observations = ["status : locked", "status : guest user", "open"]
    return [
        p + g.token_ids + tokenizer.encode(o, add_special_tokens=False)
        for p, g, o in zip(prompts, generations, observations)
    ]


def assert_same_samples(ours, theirs):
    assert [g.token_ids for g in ours] == [g.token_ids for g in theirs]
    for a, b in zip(ours, theirs):
        assert a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def policy_logprobs(policy, prompt, generation, temperature):
    ids = torch.tensor([prompt + generation.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(policy(ids)[0, :-1] / temperature, -1)
    return logp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)


def test_sessions_sample_what_replaying_the_history_samples(checkpoint, tokenizer):
    cached, replay = engine(checkpoint, tokenizer), engine(checkpoint, tokenizer, session_tokens=0)
    keys = ["e0", "e1", "e2"]
    prompts = first_prompts(tokenizer)
    first = cached.generate(prompts, [8, 8, 8], SAMPLING, keys=keys)
    assert_same_samples(first, replay.generate(prompts, [8, 8, 8], SAMPLING, keys=keys))
    assert cached.counters["prefill_tokens"] == len(prompts[0]) + len(prompts[2])  # the shared prompt once
    assert set(cached.sessions) == set(keys) and not replay.sessions

    second_prompts = next_prompts(tokenizer, prompts, first)
    prefilled = cached.counters["prefill_tokens"]
    second = cached.generate(second_prompts, [8, 8, 8], SAMPLING, keys=keys)
    assert_same_samples(second, replay.generate(second_prompts, [8, 8, 8], SAMPLING, keys=keys))
    # only what each turn adds: the last sampled token (never fed) and the observation
    added = sum(len(n) - len(p) - len(g.token_ids) + 1 for n, p, g in zip(second_prompts, prompts, first))
    assert cached.counters["prefill_tokens"] - prefilled == added
    assert cached.counters["session_hits"] == 3 and cached.counters["session_misses"] == 0

    policy, _ = load_policy(checkpoint)  # and what the trainer scores: the engine-trainer gap stays float32's
    for prompt, generation in zip(second_prompts, second):
        expected = policy_logprobs(policy, prompt, generation, SAMPLING.temperature)
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4)


def test_a_weight_update_drops_the_sessions(tiny_path, tokenizer):
    """A session's cache was computed with the old weights: after a sync the next turn prefills its whole history."""
    cached = engine(tiny_path, tokenizer)
    prompts = first_prompts(tokenizer)
    first = cached.generate(prompts, [8, 8, 8], SAMPLING, keys=["e0", "e1", "e2"])
    policy, adapter = load_policy(tiny_path)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    cached.update_weights(export_hf_state_dict(policy, adapter).items(), version=1)
    assert not cached.sessions
    second_prompts = next_prompts(tokenizer, prompts, first)
    second = cached.generate(second_prompts, [8, 8, 8], SAMPLING, keys=["e0", "e1", "e2"])
    assert cached.counters["session_hits"] == 0
    for prompt, generation in zip(second_prompts, second):
        expected = policy_logprobs(policy, prompt, generation, SAMPLING.temperature)
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4)


def test_past_the_cap_an_episode_prefills_its_whole_history(tiny_path, tokenizer):
    prompts = first_prompts(tokenizer)
    cap = len(prompts[0]) + 8  # room for one episode's session
    cached, replay = engine(tiny_path, tokenizer, session_tokens=cap), engine(tiny_path, tokenizer, session_tokens=0)
    keys = ["e0", "e1", "e2"]
    first = cached.generate(prompts, [8, 8, 8], SAMPLING, keys=keys)
    replay.generate(prompts, [8, 8, 8], SAMPLING, keys=keys)
    assert len(cached.sessions) == 1 and cached.counters["sessions_over_cap"] == 2
    assert cached.held_tokens == sum(len(s.tokens) for s in cached.sessions.values()) <= cap
    second_prompts = next_prompts(tokenizer, prompts, first)
    second = cached.generate(second_prompts, [8, 8, 8], SAMPLING, keys=keys)
    assert_same_samples(second, replay.generate(second_prompts, [8, 8, 8], SAMPLING, keys=keys))
    assert cached.counters["session_hits"] == 1


def test_a_prompt_that_does_not_extend_its_session_is_prefilled_whole(tiny_path, tokenizer):
    cached, replay = engine(tiny_path, tokenizer), engine(tiny_path, tokenizer, session_tokens=0)
    prompts = first_prompts(tokenizer)
    first = cached.generate(prompts, [8, 8, 8], SAMPLING, keys=["e0", "e1", "e2"])
    replay.generate(prompts, [8, 8, 8], SAMPLING)
    rewritten = next_prompts(tokenizer, prompts, first)
    rewritten[0] = rewritten[0][:2] + [rewritten[0][2] + 1] + rewritten[0][3:]  # its history changed
    second = cached.generate(rewritten, [8, 8, 8], SAMPLING, keys=["e0", "e1", "e2"])
    assert_same_samples(second, replay.generate(rewritten, [8, 8, 8], SAMPLING))
    assert cached.counters["session_misses"] == 1 and cached.counters["session_hits"] == 2


def test_release_drops_an_episodes_session(tiny_path, tokenizer):
    cached = engine(tiny_path, tokenizer)
    cached.generate(first_prompts(tokenizer), [4, 4, 4], SAMPLING, keys=["e0", "e1", None])
    assert set(cached.sessions) == {"e0", "e1"}  # an unkeyed request keeps nothing
    cached.release(["e0", "unknown"])
    assert set(cached.sessions) == {"e1"}


class PooledVault(EmbeddedEnvironment):
    """The vault world as if behind a pool: the agent loop runs each episode in a thread of its own."""

    max_concurrent_episodes = 4


BUDGET = Budget(max_turns=4, max_response_tokens=64, max_prompt_tokens=128, max_observation_tokens=32,
                max_context_tokens=512)  # fmt: skip


@pytest.mark.parametrize("environment", [EmbeddedEnvironment, PooledVault], ids=["in_turns", "in_threads"])
def test_rollouts_reuse_sessions_and_leave_none_behind(tiny_path, tokenizer, environment):
    """Every episode's later turns continue its session; once the rollout is over the engine holds nothing."""
    env = environment()
    jobs = [(task, i) for task in env.tasks("train")[:3] for i in range(4)]
    cached = engine(tiny_path, tokenizer)
    seen, later_turns = set(), []
    generate = cached.generate

    def recording(prompts, limits, sampling, keys):  # a turn with no tokens left to sample is not generated
        later_turns.extend(k for k, n in zip(keys, limits) if k in seen and n > 0)
        seen.update(keys)
        return generate(prompts, limits, sampling, keys)

    cached.generate = recording
    trajectories, _ = run_episodes(cached, env, tokenizer, jobs, BUDGET, SAMPLING)
    assert len(later_turns) > 0 and cached.counters["session_hits"] == len(later_turns)
    assert not cached.sessions
    if environment is EmbeddedEnvironment:  # one batch per turn in job order: the samples of a replaying engine
        replay = engine(tiny_path, tokenizer, session_tokens=0)
        again, _ = run_episodes(replay, env, tokenizer, jobs, BUDGET, SAMPLING)
        assert [t.token_ids for t in again] == [t.token_ids for t in trajectories]
