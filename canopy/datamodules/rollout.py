"""RolloutDataModule: one fresh, on-policy batch per optimizer step.

tasks (pool, tiers) -> n rollouts per task -> verdicts -> quarantine (drop exogenous faults) -> rewards ->
group advantages (Eq. 3, population std) -> padded batch. Generation happens when the trainer asks for the
batch, after the previous step's weights reached the engine; every sampled token carries the weight version
that sampled it, which the module checks against its own before it learns from the batch.
"""

import functools
import itertools
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import lightning as L
import torch
import torch.distributed as dist

from canopy.coverage import SuccessEstimates, allocate_rollouts, group_composition, group_size_for_coverage
from canopy.envs.base import Environment, SystemicFaultError, Task
from canopy.errors import ConfigError
from canopy.modules.parallel import alone_on_rank0, data_parallel_rank
from canopy.objective import step_advantages
from canopy.rollout.agent_loop import Budget, Trajectory, run_episodes
from canopy.rollout.engine import EngineHandle, SamplingParams
from canopy.rollout.faults import check_systemic_faults
from canopy.rollout_batch import RolloutBatch


def score_groups(
    trajectories: list[Trajectory], group_sizes: int | list[int], reward_kind: str, quarantine_as_failure: bool = False
) -> tuple[list[Trajectory], torch.Tensor, dict[str, float]]:
    """Quarantine, then reward, then Eq. 3 (`step_advantages`) over the step's groups of consecutive same-task
    episodes (`group_sizes`: one n for all, or each group's). Returns the survivors, their advantages and,
    computed beside them, the groups' composition (`coverage_metrics`).

    With `quarantine_as_failure` (the sensitivity ablation of Appendix G) quarantined episodes are scored 0
    instead of removed; they carry no tokens either way, since their trajectory is not the policy's doing.
    """
    groups = same_task_groups(trajectories, group_sizes)
    shape = (len(groups), max(len(group) for group in groups))
    present, quarantined, rewards = (
        torch.zeros(shape, dtype=torch.bool),
        torch.zeros(shape, dtype=torch.bool),
        torch.zeros(shape),
    )
    for g, group in enumerate(groups):
        present[g, : len(group)] = True
        quarantined[g, : len(group)] = torch.tensor([t.quarantine is not None for t in group])
        rewards[g, : len(group)] = torch.tensor([0.0 if t.quarantine else t.reward(reward_kind) for t in group])
    advantages = step_advantages(rewards, quarantined, quarantine_as_failure, present)
    survivors = [t for t in trajectories if t.quarantine is None]
    return survivors, advantages[present & ~quarantined], coverage_metrics(groups)


def same_task_groups(trajectories: list[Trajectory], group_sizes: int | list[int]) -> list[list[Trajectory]]:
    """The step's groups: consecutive episodes of one task each, `group_sizes` of them (one n for all, or each
    group's). A lost episode, or a group that mixes tasks, is an error, never a silent drop."""
    if isinstance(group_sizes, int):
        if len(trajectories) % group_sizes:
            raise RuntimeError(
                f"{len(trajectories)} episodes do not form whole groups of {group_sizes}: an episode was lost"
            )
        group_sizes = [group_sizes] * (len(trajectories) // group_sizes)
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
    return groups


def composition(group: list[Trajectory]) -> str:
    """all_fail / all_success / mixed over the group's scored episodes (Fig. 3); `empty` if all were quarantined."""
    successes = [t.verdict is not None and t.verdict.success for t in group if t.quarantine is None]
    return group_composition(sum(successes), len(successes)) if successes else "empty"


def coverage_metrics(groups: list[list[Trajectory]]) -> dict[str, float]:
    """The fraction of groups of each composition, overall and per tier (`coverage/<kind>[_tier<K>]`), the groups
    per tier and the scored rollouts per group (`coverage/group_size`, Eq. 4's n after quarantine)."""
    compositions, by_tier = Counter(), defaultdict(Counter)
    for group in groups:
        kind = composition(group)
        compositions[kind] += 1
        by_tier[group[0].task.tier][kind] += 1
    n_groups = max(1, len(groups))
    stats = {f"coverage/{kind}": compositions[kind] / n_groups for kind in ("all_fail", "all_success", "mixed")}
    stats["coverage/group_size"] = sum(t.quarantine is None for group in groups for t in group) / n_groups
    for tier, counter in sorted(by_tier.items()):
        stats[f"coverage/groups_tier{tier}"] = sum(counter.values())
        tier_groups = [group for group in groups if group[0].task.tier == tier]
        stats[f"coverage/group_size_tier{tier}"] = sum(len(group) for group in tier_groups) / len(tier_groups)
        for kind in ("all_fail", "all_success", "mixed"):
            stats[f"coverage/{kind}_tier{tier}"] = counter[kind] / max(1, sum(counter.values()))
    return stats


@dataclass
class StepStats:
    """A rollout step's statistics as the callbacks read them (the logs get `RolloutBatch.metrics`)."""

    episodes: int
    quarantined: dict[str, int] = field(default_factory=dict)  # quarantined episodes by fault reason (Appendix G)
    success_by_tier: dict[int, float] = field(default_factory=dict)  # success rate of the scored episodes
    groups_by_tier: dict[int, int] = field(default_factory=dict)
    scored_per_group: float = 0.0  # rollouts left per group after quarantine: Eq. 4's n
    scored_sizes_by_tier: dict[int, list[int]] = field(default_factory=dict)  # each group's n, by tier

    @classmethod
    def of(cls, trajectories: list[Trajectory], group_sizes: int | list[int]) -> "StepStats":
        scored = [t for t in trajectories if t.quarantine is None]
        outcomes: dict[int, list[bool]] = defaultdict(list)
        for t in scored:
            outcomes[t.task.tier].append(t.verdict is not None and t.verdict.success)
        groups = same_task_groups(trajectories, group_sizes)
        sizes: dict[int, list[int]] = defaultdict(list)
        for group in groups:
            sizes[group[0].task.tier].append(sum(t.quarantine is None for t in group))
        return cls(
            episodes=len(trajectories),
            quarantined=dict(Counter(t.quarantine for t in trajectories if t.quarantine is not None)),
            success_by_tier={tier: sum(v) / len(v) for tier, v in sorted(outcomes.items())},
            groups_by_tier={tier: len(v) for tier, v in sorted(sizes.items())},
            scored_per_group=len(scored) / max(1, len(groups)),
            scored_sizes_by_tier=dict(sorted(sizes.items())),
        )


class AdaptiveGroups:
    """`algorithm.group_size=auto` (beyond the paper): each task's group size from Eq. 5 at its running success
    estimate (`SuccessEstimates`: a pilot even split on first sight, then its own groups), the step's fixed
    `rollouts_per_step` split over its tasks in proportion (`allocate_rollouts`), between `floor` and `cap`: the
    hardest tasks get the most rollouts and every sampled task keeps at least `floor` (none is dropped)."""

    def __init__(self, rollouts_per_step: int, tau: float, floor: int, cap: int, decay: float):
        self.rollouts_per_step, self.tau, self.floor, self.cap = rollouts_per_step, tau, floor, cap
        self.estimates = SuccessEstimates(decay)

    def sizes(self, tasks: list[Task]) -> list[int]:
        wanted = [group_size_for_coverage(self.estimates.rate(t.task_id, t.tier), self.tau) for t in tasks]
        return allocate_rollouts(wanted, self.rollouts_per_step, self.floor, self.cap)

    def observe(self, groups: list[list[Trajectory]]) -> None:
        """Each group's scored outcomes (quarantined episodes left out) update its task's estimate."""
        for group in groups:
            scored = [t for t in group if t.quarantine is None]
            successes = sum(t.verdict is not None and t.verdict.success for t in scored)
            self.estimates.observe(group[0].task.task_id, group[0].task.tier, successes, len(scored))


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


def rollout_metrics(trajectories: list[Trajectory], reward_kind: str) -> dict[str, float]:
    """Per-step rollout statistics: rewards, success by tier, lengths, turns, truncation, endings."""
    scored = [t for t in trajectories if t.quarantine is None]
    metrics: dict[str, float] = {
        "rollout/episodes": len(trajectories),
        "rollout/quarantined": len(trajectories) - len(scored),
    }
    for reason, count in Counter(t.quarantine for t in trajectories if t.quarantine).items():
        metrics[f"quarantine/{reason}"] = count
    if not scored:
        return metrics
    success = [float(t.verdict is not None and t.verdict.success) for t in scored]
    metrics["reward/mean"] = sum(t.reward(reward_kind) for t in scored) / len(scored)
    metrics["reward/success"] = sum(success) / len(scored)
    by_tier: dict[int, list[float]] = defaultdict(list)
    for t, s in zip(scored, success):
        by_tier[t.task.tier].append(s)
    for tier, values in sorted(by_tier.items()):
        metrics[f"success/tier{tier}"] = sum(values) / len(values)
    metrics["rollout/response_length"] = sum(t.response_tokens for t in scored) / len(scored)
    metrics["rollout/turns"] = sum(t.num_turns for t in scored) / len(scored)
    metrics["rollout/truncated_frac"] = sum(t.truncated for t in scored) / len(scored)
    for ending, count in Counter(t.ending for t in scored).items():
        metrics[f"ending/{ending}"] = count / len(scored)
    for outcome, count in Counter(t.verdict.outcome for t in scored if t.verdict and t.verdict.outcome).items():
        metrics[f"outcome/{outcome}"] = count  # named endings of an environment (SWE-bench: resolved, no_submission...)
    for action, count in Counter(t.verdict.tamper for t in scored if t.verdict and t.verdict.tamper).items():
        metrics[f"outcome/tamper_{action}"] = count  # graded after restoring what the patch tampered with, or rejected
    return metrics


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
        self.seed, self.rollout_timeout_s, self.trajectory_log = seed, rollout_timeout_s, trajectory_log
        self.batches_delivered = 0  # rollout steps handed to the trainer by this process (every rank counts alike)
        self.split, self.drop_hardest, self.hardest_tier = split, drop_hardest, hardest_tier
        self.sampler_state = {"epoch": 0, "position": 0}
        self.step = 0

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
        generator = getattr(self.engine, "generator", None) if self.generates else None
        if generator is not None:
            state["engine_rng"] = generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.sampler_state, self.step = dict(state["sampler"]), state["step"]
        if "success_estimates" in state and isinstance(self.group_size, AdaptiveGroups):
            self.group_size.estimates.load_state_dict(state["success_estimates"])
        if "engine_rng" in state and self.generates:
            self.engine.generator.set_state(state["engine_rng"])

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
        counted = Counter(getattr(self.engine, "counters", {}))  # the local engine's prefill / decode / session counts
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
        survivors, advantages, coverage = score_groups(trajectories, sizes, self.reward, self.quarantine_as_failure)
        if adaptive:
            self.group_size.observe(same_task_groups(trajectories, sizes))
        if self.trajectory_log is not None:
            advantage_of = {id(t): a for t, a in zip(survivors, advantages.tolist())}
            self.trajectory_log.log_step("train", self.step, same_task_groups(trajectories, sizes), advantage_of)
        if not survivors:
            raise RuntimeError(
                f"rollout step {self.step}: every episode was quarantined; check the environment workers"
            )
        batch = pack(survivors, advantages, self.tokenizer.pad_token_id)
        batch.metrics = {**rollout_metrics(trajectories, self.reward), **coverage}
        batch.stats = StepStats.of(trajectories, sizes)
        batch.metrics.update({f"time/{k}": v for k, v in timings.items()})
        counts = Counter(getattr(self.engine, "counters", {}))
        batch.metrics.update({f"engine/{k}": counts[k] - counted[k] for k in counts})
        self.step += 1
        return batch
