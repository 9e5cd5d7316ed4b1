"""RolloutDataModule: one fresh, on-policy batch per optimizer step.

tasks (pool, tiers) -> n rollouts per task -> its `Group` of episodes -> verdicts -> quarantine (drop exogenous
faults) -> rewards -> group advantages (Eq. 3, population std) -> padded batch, and the step's `StepStats`, gathered
in one walk over the groups, for the logs and the callbacks. Generation happens when the trainer asks for the batch,
after the previous step's weights reached the engine; every sampled token carries the weight version that sampled it,
which the module checks against its own before it learns from the batch.
"""

import functools
import itertools
import random
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import lightning as L
import torch
import torch.distributed as dist

from canopy.coverage import SuccessEstimates, allocate_rollouts, group_composition
from canopy.envs.base import Environment, SystemicFaultError, Task
from canopy.errors import ConfigError, require
from canopy.modules.parallel import alone_on_rank0, data_parallel_rank
from canopy.objective import step_advantages
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.engine import EngineHandle, SamplingParams
from canopy.rollout.faults import check_systemic_faults
from canopy.rollout.trajectory import Trajectory, invalid_action_fracs
from canopy.rollout_batch import RolloutBatch


@dataclass
class DataSettings:
    """`data.*`, which tasks a step samples: the schema (conf/train.yaml holds the defaults)."""

    tasks_per_step: int
    split: str
    drop_hardest: bool
    hardest_tier: int | None  # null: the highest tier of the pool

    def validate(self) -> None:
        require(self.tasks_per_step >= 1, f"data.tasks_per_step={self.tasks_per_step} must be >= 1")


COMPOSITIONS = ("all_fail", "all_success", "mixed")  # Fig. 3


@dataclass(frozen=True)
class Group:
    """One task's rollouts of a step, in sampling order: Eq. 3 standardizes within it, Eq. 5 sizes it."""

    task: Task
    trajectories: list[Trajectory]

    @property
    def size(self) -> int:
        """The rollouts sampled, quarantined ones included."""
        return len(self.trajectories)

    @functools.cached_property
    def scored(self) -> list[Trajectory]:
        """The episodes left after quarantine (Appendix G): their number is Eq. 4's n."""
        return [t for t in self.trajectories if t.quarantine is None]

    @functools.cached_property
    def successes(self) -> int:
        return sum(t.verdict is not None and t.verdict.success for t in self.scored)

    @property
    def composition(self) -> str:
        """all_fail / all_success / mixed over the scored episodes (Fig. 3); `empty` if all were quarantined."""
        return group_composition(self.successes, len(self.scored)) if self.scored else "empty"


def same_task_groups(trajectories: list[Trajectory], group_sizes: list[int]) -> list[Group]:
    """The step's groups, built once after generation: consecutive episodes of one task each, `group_sizes` of them.
    A lost episode, or a group that mixes tasks, is an error, never a silent drop."""
    if len(trajectories) != sum(group_sizes):
        raise RuntimeError(
            f"{len(trajectories)} episodes for groups of {sum(group_sizes)} rollouts in all: an episode was lost"
        )
    ends = list(itertools.accumulate(group_sizes))
    groups = [trajectories[end - n : end] for end, n in zip(ends, group_sizes)]
    for group in groups:
        if len({t.task.task_id for t in group}) != 1:
            raise RuntimeError(
                f"a group mixes tasks {sorted({t.task.task_id for t in group})}: groups must be same-task"
            )
    return [Group(group[0].task, group) for group in groups]


def score_groups(
    groups: list[Group], reward_kind: str, quarantine_as_failure: bool = False, advantage_std: bool = True
) -> tuple[list[Trajectory], torch.Tensor]:
    """Quarantine, then reward, then Eq. 3 (`step_advantages`) over the step's groups, padded to the largest.
    Returns the survivors, in order, and their advantages.

    With `quarantine_as_failure` (the sensitivity ablation of Appendix G) quarantined episodes are scored 0
    instead of removed; they carry no tokens either way, since their trajectory is not the policy's doing. Without
    `advantage_std` (the no_std ablation) the advantages are only centred by the group's mean.
    """
    shape = (len(groups), max(group.size for group in groups))
    present, quarantined, rewards = (
        torch.zeros(shape, dtype=torch.bool),
        torch.zeros(shape, dtype=torch.bool),
        torch.zeros(shape),
    )
    for g, group in enumerate(groups):
        present[g, : group.size] = True
        quarantined[g, : group.size] = torch.tensor([t.quarantine is not None for t in group.trajectories])
        rewards[g, : group.size] = torch.tensor(
            [0.0 if t.quarantine else t.reward(reward_kind) for t in group.trajectories]
        )
    advantages = step_advantages(rewards, quarantined, quarantine_as_failure, present, advantage_std)
    survivors = [t for group in groups for t in group.scored]
    return survivors, advantages[present & ~quarantined]


@dataclass
class StepStats:
    """A rollout step's statistics, gathered in one walk over its groups (`of`): `metrics` is what the logs get,
    the fields what the callbacks read (`QuarantineStats`, `CoverageLogger`)."""

    episodes: int
    quarantined: dict[str, int] = field(default_factory=dict)  # quarantined episodes by fault reason (Appendix G)
    success_by_tier: dict[int, float] = field(default_factory=dict)  # success rate of the scored episodes
    groups_by_tier: dict[int, int] = field(default_factory=dict)
    scored_per_group: float = 0.0  # rollouts left per group after quarantine: Eq. 4's n
    scored_sizes_by_tier: dict[int, list[int]] = field(default_factory=dict)  # each group's n, by tier
    invalid_example: tuple[str, int] | None = None  # (task id, sample index): the first episode with an invalid action
    metrics: dict[str, float] = field(default_factory=dict)  # rollout/ quarantine/ reward/ success/ ... coverage/

    @classmethod
    def of(cls, groups: list[Group], reward_kind: str) -> "StepStats":
        """Per episode: rewards, lengths, turns, truncation, endings, invalid actions and the quarantine reasons; per
        group (Fig. 3): its tier, scored n, successes and composition (`coverage/<kind>[_tier<K>]`,
        `coverage/group_size[_tier<K>]`). Format health, `health/invalid_action_frac[_tier<K>]`: the share of the
        actions the environment answered that were invalid for it (`StepResult.valid`), over the scored episodes, as
        every per-episode statistic: a quarantined episode's actions are left out with it (a fault cut it short).
        """
        quarantined, endings, outcomes, tampers = Counter(), Counter(), Counter(), Counter()
        rewards, response_tokens, turns, truncated = [], 0, 0, 0
        by_tier: dict[int, list[Group]] = defaultdict(list)
        actions: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # tier -> [invalid actions, actions answered]
        invalid_example = None
        for group in groups:
            by_tier[group.task.tier].append(group)
            for t in group.trajectories:
                if t.quarantine is not None:
                    quarantined[t.quarantine] += 1
                    continue
                rewards.append(t.reward(reward_kind))
                response_tokens += t.response_tokens
                turns += t.num_turns
                truncated += t.truncated
                endings[t.ending] += 1
                actions[group.task.tier][0] += len(t.invalid_turns)
                actions[group.task.tier][1] += t.actions
                if t.invalid_turns and invalid_example is None:
                    invalid_example = (t.task.task_id, t.sample_index)
                if t.verdict and t.verdict.outcome:
                    outcomes[t.verdict.outcome] += 1  # an environment's named endings (SWE-bench: resolved, ...)
                if t.verdict and t.verdict.tamper:
                    tampers[t.verdict.tamper] += 1  # graded after restoring what the patch tampered with, or rejected
        by_tier = dict(sorted(by_tier.items()))
        episodes, scored = sum(group.size for group in groups), len(rewards)
        scored_by_tier = {
            tier: sum(len(group.scored) for group in tier_groups) for tier, tier_groups in by_tier.items()
        }
        success_by_tier = {
            tier: sum(group.successes for group in tier_groups) / scored_by_tier[tier]
            for tier, tier_groups in by_tier.items()
            if scored_by_tier[tier]
        }

        metrics: dict[str, float] = {"rollout/episodes": episodes, "rollout/quarantined": episodes - scored}
        metrics.update({f"quarantine/{reason}": count for reason, count in quarantined.items()})
        if scored:
            metrics["reward/mean"] = sum(rewards) / scored
            metrics["reward/success"] = sum(group.successes for group in groups) / scored
            metrics.update({f"success/tier{tier}": rate for tier, rate in success_by_tier.items()})
            metrics["rollout/response_length"] = response_tokens / scored
            metrics["rollout/turns"] = turns / scored
            metrics["rollout/truncated_frac"] = truncated / scored
            metrics.update({f"ending/{ending}": count / scored for ending, count in endings.items()})
            metrics.update({f"outcome/{outcome}": count for outcome, count in outcomes.items()})
            metrics.update({f"outcome/tamper_{action}": count for action, count in tampers.items()})
        for name, share in invalid_action_fracs(actions).items():  # "all", then "tier<K>"
            metrics["health/invalid_action_frac" + ("" if name == "all" else f"_{name}")] = share
        n_groups = max(1, len(groups))
        compositions = Counter(group.composition for group in groups)
        metrics.update({f"coverage/{kind}": compositions[kind] / n_groups for kind in COMPOSITIONS})
        metrics["coverage/group_size"] = scored / n_groups
        for tier, tier_groups in by_tier.items():
            metrics[f"coverage/groups_tier{tier}"] = len(tier_groups)
            metrics[f"coverage/group_size_tier{tier}"] = sum(group.size for group in tier_groups) / len(tier_groups)
            kinds = Counter(group.composition for group in tier_groups)
            metrics.update({f"coverage/{kind}_tier{tier}": kinds[kind] / len(tier_groups) for kind in COMPOSITIONS})
        return cls(
            episodes=episodes,
            quarantined=dict(quarantined),
            success_by_tier=success_by_tier,
            groups_by_tier={tier: len(tier_groups) for tier, tier_groups in by_tier.items()},
            scored_per_group=scored / n_groups,
            scored_sizes_by_tier={
                tier: [len(group.scored) for group in tier_groups] for tier, tier_groups in by_tier.items()
            },
            invalid_example=invalid_example,
            metrics=metrics,
        )


class AdaptiveGroups:
    """`algorithm.group_size=auto` (beyond the paper): the step's fixed `rollouts_per_step` split over its tasks to
    maximize the expected number of mixed groups (Eq. 4 summed, `allocate_rollouts`) at each task's running success
    estimate (`SuccessEstimates`: a pilot even split on first sight, then its own groups), each between `floor` and
    `cap`: the tasks nearest p = 1/2 get the most rollouts, and every sampled task keeps at least `floor` (none is
    dropped)."""

    def __init__(self, rollouts_per_step: int, floor: int, cap: int, decay: float):
        self.rollouts_per_step, self.floor, self.cap = rollouts_per_step, floor, cap
        self.estimates = SuccessEstimates(decay)

    def sizes(self, tasks: list[Task]) -> list[int]:
        rates = [self.estimates.rate(t.task_id, t.tier) for t in tasks]
        return allocate_rollouts(rates, self.rollouts_per_step, self.floor, self.cap)

    def observe(self, groups: list[Group]) -> None:
        """Each group's scored outcomes (quarantined episodes left out) update its task's estimate."""
        for group in groups:
            self.estimates.observe(group.task.task_id, group.task.tier, group.successes, len(group.scored))


def pack(trajectories: list[Trajectory], advantages: torch.Tensor, pad_token_id: int) -> RolloutBatch:
    lengths = torch.tensor([len(t.token_ids) for t in trajectories])
    width = int(lengths.max()) if len(trajectories) else 1
    input_ids = torch.full((len(trajectories), width), pad_token_id, dtype=torch.long)
    action_mask = torch.zeros((len(trajectories), width), dtype=torch.bool)
    engine_logprobs = torch.zeros((len(trajectories), width))
    token_versions = torch.full((len(trajectories), width), -1, dtype=torch.long)
    for row, t in enumerate(trajectories):
        input_ids[row, : len(t.token_ids)] = torch.tensor(t.token_ids)
        action_mask[row, : len(t.token_ids)] = torch.tensor(t.action_mask, dtype=torch.bool)
        engine_logprobs[row, : len(t.token_ids)] = torch.tensor(t.engine_logprobs)
        token_versions[row, : len(t.token_ids)] = torch.tensor(t.token_versions, dtype=torch.long)
    return RolloutBatch(input_ids, action_mask, engine_logprobs, token_versions, advantages, lengths, {})


class RolloutStream:
    """The iterable Lightning pulls from: each `next()` runs one full rollout step. Its length (the trainer's
    max_steps, when known) only sizes the progress bar and its ETA."""

    def __init__(self, datamodule: "RolloutDataModule", length: int | None = None):
        self.datamodule, self.length = datamodule, length

    def __iter__(self):
        return self

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this rollout stream is endless")
        return self.length

    def __next__(self) -> RolloutBatch:
        """One process: the step's batch. Several: global rank 0 generates while the others wait outside any
        collective, on the process group's store, for up to `rollout_timeout_s` (a rollout step can outlast any
        collective's timeout); then each rank receives only its data-parallel shard's rows. A failure of rank 0's
        rollout (a broken setup, `SystemicFaultError`) reaches every rank, which stops with it."""
        dm, trainer = self.datamodule, self.datamodule.trainer
        if trainer is None or trainer.world_size == 1:
            return dm.next_batch()
        layout = dm.shard_layout
        key = f"canopy/rollout/{dm.batches_delivered}"
        dm.batches_delivered += 1

        def deal_rows():  # (each shard's rows, None), or (rank 0's error as each rank should raise it, the error)
            try:
                return split_rows(dm.next_batch(), layout.dp_size, layout.min_rows), None
            except Exception as error:  # noqa: BLE001 (relayed to every rank, then raised here too)
                return [relayable(error)] * layout.dp_size, error

        dealt = alone_on_rank0(trainer, key, "rollout step", deal_rows)
        shards, failure = dealt or (None, None)
        received = [None]
        to_ranks = [shards[shard] for shard in layout.shard_of_rank] if shards is not None else None
        dist.scatter_object_list(received, to_ranks, src=0)
        if failure is not None:
            raise failure
        if isinstance(received[0], Exception):
            raise received[0]
        return received[0]


@dataclass(frozen=True)
class ShardLayout:
    """Which data-parallel shard each global rank trains (its TP / CP ranks share the shard's rows)."""

    shard_of_rank: list[int]
    dp_size: int
    min_rows: int  # rows each shard needs: one per update of the step


def split_rows(batch: RolloutBatch, dp_size: int, min_rows: int = 1) -> list[RolloutBatch]:
    """The batch's rows dealt round-robin to `dp_size` shards, each trimmed to its own longest row and carrying
    the whole step's metrics and stats. Each shard divides by the batch-wide action-token count, so the summed
    gradients are Eq. 8 exactly."""
    if len(batch.lengths) < dp_size * min_rows:
        raise SystemicFaultError(
            f"{len(batch.lengths)} surviving episodes cannot feed {dp_size} data-parallel shards x {min_rows} "
            "update(s): raise data.tasks_per_step or lower the data-parallel degree"
        )
    shards = [batch.select(torch.arange(len(batch.lengths))[shard::dp_size]) for shard in range(dp_size)]
    for shard in shards:
        shard.metrics, shard.stats = batch.metrics, batch.stats
    return shards


def relayable(error: Exception) -> Exception:
    """`error` as the other ranks should raise it: the run's own stop reasons as they are, anything else named."""
    from canopy.mismatch import OffPolicyError

    if isinstance(error, (SystemicFaultError, OffPolicyError, ConfigError)):
        return error
    return RuntimeError(f"rank 0's rollout step failed with {type(error).__name__}: {error}")


class RolloutDataModule(L.LightningDataModule):
    """Samples `tasks_per_step` tasks, runs `group_size` rollouts of each (or, given `AdaptiveGroups`, as many as
    it allots each task), scores and packs them.

    `engine` is the run's `EngineHandle` (or an engine, or a zero-argument function that builds one, wrapped in
    a handle here): with several processes only global rank 0 generates, so the other ranks never build one.
    """

    def __init__(
        self,
        env: Environment,
        engine,
        tokenizer,
        *,
        split: str,
        tasks_per_step: int,
        group_size: "int | AdaptiveGroups",
        budget: Budget,
        sampling: SamplingParams,
        reward: str = "sparse",
        drop_hardest: bool = False,
        hardest_tier: int | None = None,
        quarantine_as_failure: bool = False,
        advantage_std: bool = True,
        max_quarantine_fraction: float = 0.5,
        rollout_timeout_s: float = 14400.0,
        trajectory_log=None,
        seed: int = 0,
    ):
        """`rollout_timeout_s`: how long the other ranks of a sharded run wait for rank 0's rollout step;
        `trajectory_log`: a `canopy.trajectories.TrajectoryLog` the sampled episodes of each step go to."""
        super().__init__()
        self.env, self.tokenizer = env, tokenizer
        self.engine_handle = engine if isinstance(engine, EngineHandle) else EngineHandle(engine)
        self.group_size, self.tasks_per_step = group_size, tasks_per_step
        self.budget, self.sampling, self.reward = budget, sampling, reward
        self.quarantine_as_failure, self.max_quarantine_fraction = quarantine_as_failure, max_quarantine_fraction
        self.advantage_std = advantage_std
        self.seed, self.rollout_timeout_s, self.trajectory_log = seed, rollout_timeout_s, trajectory_log
        self.batches_delivered = 0  # rollout steps handed to the trainer by this process (every rank counts alike)
        self.split, self.drop_hardest, self.hardest_tier = split, drop_hardest, hardest_tier
        self.sampler_state = {"epoch": 0, "position": 0}
        self.step = 0
        self.warned_unreadable = False

    @functools.cached_property
    def tasks(self) -> list[Task]:
        """The training pool, listed on first use (only the generating rank needs it)."""
        tasks = self.env.tasks(self.split)
        if self.drop_hardest:
            hardest = self.hardest_tier if self.hardest_tier is not None else max(t.tier for t in tasks)
            tasks = [t for t in tasks if t.tier != hardest]
        if not tasks:
            raise ValueError(f"split {self.split!r} of environment {self.env.name!r} has no tasks")
        return tasks

    @functools.cached_property
    def shard_layout(self) -> ShardLayout:
        """Every rank's data-parallel shard, gathered once (a collective: every rank asks at its first step)."""
        module = self.trainer.lightning_module
        ranks = [None] * self.trainer.world_size
        dist.all_gather_object(ranks, data_parallel_rank(getattr(module, "parallel_dims", None)))
        return ShardLayout([shard for shard, _ in ranks], ranks[0][1], getattr(module, "updates_per_batch", 1))

    def teardown(self, stage: str) -> None:
        """Write the queued trajectory logs; stop the environment's worker processes, if it has any."""
        if self.trajectory_log is not None:
            self.trajectory_log.close()
        if hasattr(self.env, "close"):
            self.env.close()

    @property
    def engine(self):
        """The run's engine (built on first use): only the generating process asks for it."""
        return self.engine_handle.engine

    @property
    def generates(self) -> bool:
        """Whether this process runs the engine (global rank 0, or the only process)."""
        return self.trainer is None or self.trainer.is_global_zero

    def train_dataloader(self) -> RolloutStream:
        """The stream, as long as the run's rollout steps: `max_steps` counts optimizer steps, and each batch
        feeds the module's `updates_per_batch` of them (1, but for the half_minibatch ablation)."""
        trainer = self.trainer
        if trainer is None or trainer.max_steps <= 0:
            return RolloutStream(self)
        updates = getattr(trainer.lightning_module, "updates_per_batch", 1)
        return RolloutStream(self, -(-trainer.max_steps // updates))

    def state_dict(self) -> dict:
        """Where the task sampler stands, the adaptive groups' success estimates and the engine's sampling RNG: with
        the module's state, an exact resume."""
        state = {"sampler": dict(self.sampler_state), "step": self.step}
        if isinstance(self.group_size, AdaptiveGroups):
            state["success_estimates"] = self.group_size.estimates.state_dict()
        rng = self.engine.rng_state() if self.generates else None
        if rng is not None:
            state["engine_rng"] = rng
        return state

    def load_state_dict(self, state: dict) -> None:
        self.sampler_state, self.step = dict(state["sampler"]), state["step"]
        if "success_estimates" in state and isinstance(self.group_size, AdaptiveGroups):
            self.group_size.estimates.load_state_dict(state["success_estimates"])
        if "engine_rng" in state and self.generates:
            self.engine.load_rng_state(state["engine_rng"])

    def sample_tasks(self) -> list[Task]:
        """Walk a seeded shuffle of the pool epoch by epoch, as a dataloader over tasks would."""
        chosen = []
        while len(chosen) < self.tasks_per_step:
            order = list(range(len(self.tasks)))
            random.Random(self.seed + self.sampler_state["epoch"]).shuffle(order)
            take = order[
                self.sampler_state["position"] : self.sampler_state["position"] + self.tasks_per_step - len(chosen)
            ]
            chosen += [self.tasks[i] for i in take]
            self.sampler_state["position"] += len(take)
            if self.sampler_state["position"] >= len(self.tasks):
                self.sampler_state = {"epoch": self.sampler_state["epoch"] + 1, "position": 0}
        return chosen

    def next_batch(self) -> RolloutBatch:
        tasks = self.sample_tasks()
        adaptive = isinstance(self.group_size, AdaptiveGroups)
        sizes = self.group_size.sizes(tasks) if adaptive else [self.group_size] * len(tasks)
        jobs = [(task, i) for task, n in zip(tasks, sizes) for i in range(n)]
        counted = Counter(self.engine.counters)  # the local engine's prefill / decode / session counts
        trajectories, timings = run_episodes(
            self.engine,
            self.env,
            self.tokenizer,
            jobs,
            self.budget,
            self.sampling,
            seed=self.seed + 1_000_003 * self.step,
            description=f"rollout step {self.step}",
        )
        check_systemic_faults(
            trajectories,
            self.max_quarantine_fraction,
            getattr(self.env, "max_concurrent_episodes", None),
            f"rollout step {self.step}",
        )
        groups = same_task_groups(trajectories, sizes)
        survivors, advantages = score_groups(groups, self.reward, self.quarantine_as_failure, self.advantage_std)
        stats = StepStats.of(groups, self.reward)
        if adaptive:
            self.group_size.observe(groups)
        if self.trajectory_log is not None:
            advantage_of = {id(t): a for t, a in zip(survivors, advantages.tolist())}
            self.trajectory_log.log_step("train", self.step, [group.trajectories for group in groups], advantage_of)
        if not survivors:
            raise RuntimeError(
                f"rollout step {self.step}: every episode was quarantined; check the environment workers"
            )
        batch = pack(survivors, advantages, self.tokenizer.pad_token_id)
        batch.metrics, batch.stats = dict(stats.metrics), stats
        batch.metrics.update({f"time/{k}": v for k, v in timings.items()})
        counts = Counter(self.engine.counters)
        batch.metrics.update({f"engine/{k}": counts[k] - counted[k] for k in counts})
        self.check_readable(trajectories, batch.metrics)
        self.step += 1
        return batch

    def check_readable(self, trajectories: list[Trajectory], metrics: dict) -> None:
        """`health/unknown_prompt_frac`: the share of the step's prompt and observation tokens (special tokens
        aside) that are the tokenizer's unknown token; past half, once per run, a warning that the policy cannot
        read the environment."""
        unk, special = self.tokenizer.unk_token_id, set(self.tokenizer.all_special_ids) - {self.tokenizer.unk_token_id}
        if unk is None:  # a byte-level tokenizer encodes any text
            return
        read = [t for e in trajectories for t, mask in zip(e.token_ids, e.action_mask) if not mask and t not in special]
        metrics["health/unknown_prompt_frac"] = share = sum(token == unk for token in read) / max(1, len(read))
        if share > 0.5 and not self.warned_unreadable:
            self.warned_unreadable = True
            warnings.warn(
                f"rollout step {self.step}: {share:.0%} of the prompts' tokens are the tokenizer's unknown token "
                f"{self.tokenizer.unk_token!r}, so the policy cannot read this environment's text: with the embedded "
                "tiny model, set model.tiny.tokenizer=byte model.tiny.format_warmup_steps=0",
                stacklevel=2,
            )
