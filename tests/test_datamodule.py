import math

import pytest
import torch

from canopy.coverage import AdaptiveGroupSettings, signal_coverage
from canopy.envs.base import Task
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.rollout.local import LocalEngine
from canopy.step import AdaptiveGroups, Group, StepStats, pack, same_task_groups, score_groups
from tests.helpers import datamodule, group_advantages, trajectory
from tests.scripted import ScriptedEngine


def test_score_groups_quarantines_before_advantages():
    a, b = Task("a", 1, "s"), Task("b", 3, "s")
    trajectories = [
        trajectory(a, 0, True),
        trajectory(a, 1, False),
        trajectory(a, 2, quarantine="worker_dead"),
        trajectory(a, 3, False),
        trajectory(b, 0, False),
        trajectory(b, 1, False),
        trajectory(b, 2, False),
        trajectory(b, 3, False),
    ]
    groups = same_task_groups(trajectories, [4, 4])
    survivors, advantages = score_groups(groups, "sparse")
    stats = StepStats.of(groups, "sparse").metrics
    assert len(survivors) == 7 and all(t.quarantine is None for t in survivors)
    assert advantages[0].item() == pytest.approx(math.sqrt(2))  # lone success among the 3 survivors
    assert advantages[3:].abs().sum().item() == 0.0  # the all-fail group carries no signal
    assert stats["coverage/mixed"] == 0.5 and stats["coverage/all_fail"] == 0.5
    assert stats["coverage/mixed_tier1"] == 1.0 and stats["coverage/mixed_tier3"] == 0.0
    # the sensitivity ablation scores the quarantined episode 0 instead: the group has 4 members again
    _, as_failure = score_groups(groups, "sparse", quarantine_as_failure=True)
    assert as_failure[0].item() == pytest.approx(math.sqrt(3))
    # ablation=no_std: centred only, over the same 3 survivors
    _, centred = score_groups(groups, "sparse", advantage_std=False)
    assert centred.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0])


def test_score_groups_refuses_a_lost_episode():
    a = Task("a", 1, "s")
    with pytest.raises(RuntimeError, match="lost"):
        same_task_groups([trajectory(a, i, True) for i in range(3)], [4])
    with pytest.raises(RuntimeError, match="same-task"):
        same_task_groups([trajectory(a, 0, True), trajectory(Task("b", 1, "s"), 1, True)], [2])


def test_groups_of_different_sizes_each_get_their_own_eq3():
    """`group_size=auto` gives each task its own n: each group is standardized on its own (population std over its
    survivors), exactly as it would be alone."""
    a, b, c = Task("a", 3, "s"), Task("b", 1, "s"), Task("c", 2, "s")
    trajectories = [trajectory(a, 0, True)] + [trajectory(a, i, False) for i in range(1, 6)]
    trajectories += [trajectory(b, 0, True), trajectory(b, 1, False)]
    trajectories += [trajectory(c, 0, False), trajectory(c, 1, quarantine="worker_dead"), trajectory(c, 2, True)]
    groups = same_task_groups(trajectories, [6, 2, 3])
    survivors, advantages = score_groups(groups, "sparse")
    stats = StepStats.of(groups, "sparse").metrics
    assert len(survivors) == 10
    expected = []
    for group in ([1.0, 0, 0, 0, 0, 0], [1.0, 0.0], [0.0, 1.0]):
        expected += group_advantages(torch.tensor(group), torch.ones(len(group), dtype=torch.bool)).tolist()
    assert advantages.tolist() == pytest.approx(expected)
    assert advantages[0].item() == pytest.approx(math.sqrt(5))  # a lone success among 6 (Appendix B)
    assert stats["coverage/group_size_tier3"] == 6 and stats["coverage/group_size_tier2"] == 3
    step = StepStats.of(groups, "sparse")
    assert step.scored_sizes_by_tier == {1: [2], 2: [2], 3: [6]} and step.groups_by_tier == {1: 1, 2: 1, 3: 1}
    with pytest.raises(RuntimeError, match="11 episodes for groups of 10 rollouts in all"):
        same_task_groups(trajectories, [6, 2, 2])


def test_adaptive_groups_split_a_fixed_budget_for_the_most_mixed_groups(tokenizer):
    """The first step splits the rollouts evenly (the pilot); then by each task's success estimate, for the most
    expected mixed groups (Eq. 4 summed): the task at 4 of 8 mixes with few rollouts, the all-fail one needs more."""
    adaptive = AdaptiveGroupSettings(mean=8, floor=2, cap=16, decay=0.5)
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login"]), group_size="auto", adaptive_group=adaptive)
    groups = dm.group_size
    assert isinstance(groups, AdaptiveGroups) and groups.rollouts_per_step == 24
    tasks = dm.sample_tasks()
    assert groups.sizes(tasks) == [8, 8, 8]
    hard, easy, middling = tasks
    groups.observe(
        [
            Group(hard, [trajectory(hard, i, False) for i in range(8)]),
            Group(easy, [trajectory(easy, i, True) for i in range(8)]),
        ]
    )
    groups.observe([Group(middling, [trajectory(middling, i, i < 4) for i in range(8)])])
    sizes = groups.sizes(tasks)
    rates = [groups.estimates.rate(t.task_id, t.tier) for t in tasks]
    assert sum(sizes) == 24 and all(2 <= n <= 16 for n in sizes) and sizes[0] > sizes[2]
    mixed = lambda ns: sum(signal_coverage(p, n) for p, n in zip(rates, ns))  # noqa: E731
    assert mixed(sizes) > mixed([8, 8, 8])
    batch = dm.next_batch()  # a whole step: its episodes number the budget, each group its own allotment
    assert (
        batch.metrics["rollout/episodes"] == 24 and sum(sum(v) for v in batch.stats.scored_sizes_by_tier.values()) == 24
    )
    assert dm.state_dict()["success_estimates"] == groups.estimates.state_dict()


def test_pack_and_micro_batches_cover_every_sequence_once():
    a = Task("a", 1, "s")
    trajectories = [trajectory(a, i, i % 2 == 0, length=3 + 2 * i, version=3) for i in range(6)]
    batch = pack(trajectories, torch.arange(6.0), pad_token_id=0)
    assert batch.input_ids.shape == (6, 13)
    assert torch.equal(batch.token_versions, torch.where(batch.action_mask, 3, -1))
    assert batch.num_action_tokens == sum(t.action_mask[1:].count(1) for t in trajectories)
    groups = batch.micro_batches(max_tokens=26)
    assert sorted(torch.cat(groups).tolist()) == list(range(6))
    for group in groups:
        assert int(batch.lengths[group].max()) * len(group) <= 26 or len(group) == 1
    sub = batch.select(torch.tensor([0, 1]))
    assert sub.input_ids.shape == (2, 5) and torch.equal(sub.advantages, torch.tensor([0.0, 1.0]))
    assert torch.equal(sub.token_versions, batch.token_versions[:2, :5])


def test_pack_puts_each_token_at_its_row_and_position():
    """Every field of every episode, at its own row from position 0, padded after its end (pad id, mask off,
    logprob 0, version -1); and `to` keeps the batch's metrics and stats without walking them."""
    a = Task("a", 1, "s")
    trajectories = [trajectory(a, i, i % 2 == 0, length=2 + 3 * i, version=i) for i in range(4)]
    for i, t in enumerate(trajectories):
        t.token_ids = [10 * i + k for k in range(len(t.token_ids))]
        t.engine_logprobs = [-0.1 * (k + 1) if m else 0.0 for k, m in enumerate(t.action_mask)]
    batch = pack(trajectories, torch.arange(4.0), pad_token_id=7)
    width = batch.input_ids.shape[1]
    for row, t in enumerate(trajectories):
        n = len(t.token_ids)
        assert batch.input_ids[row].tolist() == t.token_ids + [7] * (width - n)
        assert batch.action_mask[row].tolist() == [bool(m) for m in t.action_mask] + [False] * (width - n)
        assert torch.equal(batch.engine_logprobs[row], torch.tensor(t.engine_logprobs + [0.0] * (width - n)))
        assert batch.token_versions[row].tolist() == t.token_versions + [-1] * (width - n)
        assert int(batch.lengths[row]) == n
    batch.metrics, batch.stats = {"m": 1.0}, object()
    moved = batch.to(torch.device("cpu"))
    assert moved.metrics is batch.metrics and moved.stats is batch.stats
    assert torch.equal(moved.input_ids, batch.input_ids) and torch.equal(moved.lengths, batch.lengths)


def test_next_batch_runs_groups_and_logs_metrics(tokenizer):
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login", "key", "unlock"]))
    batch = next(iter(dm.train_dataloader()))
    assert len(batch.lengths) == 12
    m = batch.metrics
    assert m["rollout/episodes"] == 12 and m["rollout/quarantined"] == 0
    assert 0.0 <= m["reward/success"] <= 1.0 and "time/generation" in m and "rollout/turns" in m
    assert batch.input_ids.shape[1] == int(batch.lengths.max())


def test_the_local_engines_counts_are_logged_per_step(tiny_path, tokenizer):
    """engine/*: what this step's rollout prefilled and decoded, and how many turns continued a session."""
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = LocalEngine(tiny_path, stops, tokenizer.pad_token_id, seed=0)
    dm = datamodule(tokenizer, engine, tasks_per_step=2, group_size=2)
    batches = iter(dm.train_dataloader())
    first, second = next(batches).metrics, next(batches).metrics
    for m in (first, second):
        assert m["engine/prefill_tokens"] > 0 and m["engine/decode_tokens"] > 0
    assert first["engine/prefill_tokens"] + second["engine/prefill_tokens"] == engine.counters["prefill_tokens"]
    assert first.get("engine/session_hits", 0) + second.get("engine/session_hits", 0) == engine.counters["session_hits"]


def test_injected_faults_are_quarantined_and_scored_as_the_variant_says(tokenizer):
    """env.fault_rate on the vault world: the faulted episodes are quarantined with their reason and carry no tokens;
    Appendix G's sensitivity variant scores them as failures inside their groups instead of removing them."""
    batches = {}
    for as_failure in (False, True):
        engine = ScriptedEngine(tokenizer, ["login", "key", "unlock"])  # solves the tasks that start at step 0
        dm = datamodule(tokenizer, engine, tasks_per_step=6, group_size=8, quarantine_as_failure=as_failure)
        dm.env = EmbeddedEnvironment(fault_rate=0.15)
        batches[as_failure] = next(iter(dm.train_dataloader()))
    removed, as_failures = batches[False], batches[True]
    quarantined = removed.stats.quarantined["injected_fault"]
    assert removed.metrics["rollout/quarantined"] == quarantined and 6 <= quarantined <= 30  # ~1 - 0.85^3 of 48
    assert as_failures.stats.quarantined == removed.stats.quarantined  # the same faults: fixed by (task, seed, turn)
    assert len(removed.lengths) == len(as_failures.lengths) == 48 - quarantined  # no tokens either way
    assert abs(removed.advantages.sum().item()) < 1e-4  # each group standardized over its survivors
    assert as_failures.advantages.sum().item() > 0.5  # the quarantined zeros, dropped, pulled each group mean down


def test_every_sampled_token_carries_the_version_that_sampled_it(tokenizer):
    """The batch records what the engine stamped on each generation, not what the trainer expects (the module
    compares them: tests/test_module.py)."""
    engine = ScriptedEngine(tokenizer, ["login"])
    dm = datamodule(tokenizer, engine)
    dm.engine_handle.sync(iter(()), 1, generating=True)
    batch = next(iter(dm.train_dataloader()))
    assert batch.action_mask.any() and torch.equal(batch.token_versions, torch.where(batch.action_mask, 1, -1))
    engine.weight_version = 0  # the engine missed a sync: its samples come from older weights
    batch = dm.next_batch()
    assert torch.equal(batch.token_versions, torch.where(batch.action_mask, 0, -1))


def test_a_task_drawn_twice_in_one_step_forms_two_groups(tokenizer):
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login"]), tasks_per_step=5, group_size=2)
    dm.tasks = dm.tasks[:3]  # a 3-task pool: a 5-task step straddles two epochs
    batch = dm.next_batch()
    assert len(batch.lengths) == 10


def test_task_sampler_walks_epochs_and_resumes(tokenizer):
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login"]), tasks_per_step=7)
    pool = len(dm.tasks)
    seen = [t.task_id for _ in range(pool) for t in dm.sample_tasks()]
    first_epoch = seen[:pool]
    assert sorted(first_epoch) == sorted(t.task_id for t in dm.tasks)  # every task once per epoch
    state = dm.state_dict()
    following = [t.task_id for t in dm.sample_tasks()]
    dm2 = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login"]), tasks_per_step=7)
    dm2.load_state_dict(state)
    assert [t.task_id for t in dm2.sample_tasks()] == following


def test_drop_hardest_removes_the_top_tier(tokenizer):
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login"]), drop_hardest=True)
    assert {t.tier for t in dm.tasks} == {1, 2}


def test_step_stats_are_what_the_callbacks_read():
    a, b = Task("a", 1, "s"), Task("b", 3, "s")
    trajectories = [trajectory(a, 0, True), trajectory(a, 1, False), trajectory(a, 2, quarantine="worker_killed")]
    trajectories += [trajectory(a, 3, True)] + [trajectory(b, i, False) for i in range(4)]
    stats = StepStats.of(same_task_groups(trajectories, [4, 4]), "sparse")
    assert (stats.episodes, stats.quarantined) == (8, {"worker_killed": 1})
    assert stats.success_by_tier == {1: 2 / 3, 3: 0.0} and stats.groups_by_tier == {1: 1, 3: 1}
    assert stats.scored_per_group == 3.5


def test_invalid_action_share_counts_the_scored_episodes_actions_by_tier():
    """health/invalid_action_frac: invalid actions over the actions the environment answered, pooled over the scored
    episodes, overall and per tier; a quarantined episode's actions are left out with it."""
    a, b, c = Task("a", 1, "s"), Task("b", 3, "s"), Task("c", 2, "s")
    trajectories = [trajectory(a, i, i == 0) for i in range(4)]
    trajectories += [trajectory(b, i, False) for i in range(3)] + [trajectory(b, 3, quarantine="worker_killed")]
    trajectories += [trajectory(c, i, False) for i in range(2)]
    answered = [(3, []), (4, [2]), (2, [1, 2]), (1, []), (5, [1, 2, 3]), (0, []), (5, [5]), (3, [1, 2, 3])]
    answered += [(0, []), (0, [])]  # tier 2: every episode ended before the environment answered anything
    for t, (actions, invalid) in zip(trajectories, answered):
        t.actions, t.invalid_turns = actions, invalid
    stats = StepStats.of(same_task_groups(trajectories, [4, 4, 2]), "sparse")
    health = {k: v for k, v in stats.metrics.items() if k.startswith("health/")}
    # tier 1: 3 invalid of 10 answered; tier 3: 4 of 10 (the quarantined episode's 3 of 3 are not counted)
    assert health == {
        "health/invalid_action_frac": pytest.approx(7 / 20),
        "health/invalid_action_frac_tier1": pytest.approx(3 / 10),
        "health/invalid_action_frac_tier3": pytest.approx(4 / 10),
    }
    assert stats.invalid_example == ("a", 1)  # the first scored episode with an invalid action: what the monitor names
    silent = StepStats.of(same_task_groups(trajectories[-2:], [2]), "sparse")
    assert not any(k.startswith("health/") for k in silent.metrics) and silent.invalid_example is None


def test_every_batch_carries_its_step_stats(tokenizer):
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login"]), group_size=2)
    batch = dm.next_batch()
    assert batch.stats.episodes == 6 == batch.metrics["rollout/episodes"] and batch.stats.quarantined == {}
    assert batch.stats.scored_per_group == 2.0 and sum(batch.stats.groups_by_tier.values()) == 3
