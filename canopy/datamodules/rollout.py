"""RolloutDataModule: one fresh, on-policy batch per optimizer step (Sec. 3.3).

tasks (pool, tiers) -> n rollouts per task (`run_episodes`) -> the step's groups, scored and packed (`canopy.step`:
quarantine, rewards, Eq. 3, `StepStats`) -> the batch, dealt to the data-parallel ranks. Generation happens when the
trainer asks for the batch, after the previous step's weights reached the engine; every sampled token carries the
weight version that sampled it, which the module checks against its own before it learns from the batch.
"""

import functools
import random
import warnings
from collections import Counter
from dataclasses import dataclass

import lightning as L
import torch
import torch.distributed as dist

from canopy.envs.base import Environment, SystemicFaultError, Task
from canopy.errors import RunStopped, require
from canopy.modules.canopy_module import AlgorithmSettings
from canopy.modules.parallel import alone_on_rank0, data_parallel_rank
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget, BudgetSettings
from canopy.rollout.engine import EngineHandle, SamplingParams
from canopy.rollout.faults import check_systemic_faults
from canopy.rollout.trajectory import Trajectory
from canopy.step import AdaptiveGroups, RolloutBatch, StepStats, pack, same_task_groups, score_groups


@dataclass
class DataSettings:
    """`data.*`, which tasks a step samples: the schema (conf/train.yaml holds the defaults)."""

    tasks_per_step: int
    split: str
    drop_hardest: bool
    hardest_tier: int | None  # null: the highest tier of the pool

    def validate(self) -> None:
        require(self.tasks_per_step >= 1, f"data.tasks_per_step={self.tasks_per_step} must be >= 1")


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
    if isinstance(error, RunStopped):
        return error
    return RuntimeError(f"rank 0's rollout step failed with {type(error).__name__}: {error}")


class RolloutDataModule(L.LightningDataModule):
    """Samples `data.tasks_per_step` tasks, runs `algorithm.group_size` rollouts of each (with `auto`, as many as
    `AdaptiveGroups` allots each task), scores and packs them. Takes each settings object whole, as the config
    composes it (`canopy.build.build_datamodule`).

    `engine` is the run's `EngineHandle` (or an engine, or a zero-argument function that builds one, wrapped in
    a handle here): with several processes only global rank 0 generates, so the other ranks never build one.
    """

    def __init__(
        self,
        env: Environment,
        engine,
        tokenizer,
        *,
        data: DataSettings,
        algorithm: AlgorithmSettings,
        budget: BudgetSettings,
        sampling: SamplingParams,
        max_quarantine_fraction: float,
        rollout_timeout_s: float,
        seed: int,
        trajectory_log=None,
    ):
        """`max_quarantine_fraction` (`env.*`): a step quarantining more stops the run; `rollout_timeout_s`
        (`trainer.*`): how long the other ranks of a sharded run wait for rank 0's rollout step; `trajectory_log`: a
        `canopy.trajectories.TrajectoryLog` the sampled episodes of each step go to."""
        super().__init__()
        self.env, self.tokenizer = env, tokenizer
        self.engine_handle = engine if isinstance(engine, EngineHandle) else EngineHandle(engine)
        self.data, self.algorithm, self.sampling = data, algorithm, sampling
        self.budget = Budget.of(budget)
        self.group_size = (  # n, or with auto the step's data.tasks_per_step x mean rollouts split over its tasks
            algorithm.group_size
            if algorithm.group_size != "auto"
            else AdaptiveGroups(data.tasks_per_step * algorithm.adaptive_group.mean, algorithm.adaptive_group)
        )
        self.max_quarantine_fraction = max_quarantine_fraction
        self.seed, self.rollout_timeout_s, self.trajectory_log = seed, rollout_timeout_s, trajectory_log
        self.batches_delivered = 0  # rollout steps handed to the trainer by this process (every rank counts alike)
        self.sampler_state = {"epoch": 0, "position": 0}
        self.step = 0
        self.warned_unreadable = False

    @functools.cached_property
    def tasks(self) -> list[Task]:
        """The training pool, listed on first use (only the generating rank needs it)."""
        data = self.data
        tasks = self.env.tasks(data.split)
        if data.drop_hardest:
            hardest = data.hardest_tier if data.hardest_tier is not None else max(t.tier for t in tasks)
            tasks = [t for t in tasks if t.tier != hardest]
        if not tasks:
            raise ValueError(f"split {data.split!r} of environment {self.env.name!r} has no tasks")
        return tasks

    @functools.cached_property
    def shard_layout(self) -> ShardLayout:
        """Every rank's data-parallel shard, gathered once (a collective: every rank asks at its first step)."""
        module = self.trainer.lightning_module
        ranks = [None] * self.trainer.world_size
        dist.all_gather_object(ranks, data_parallel_rank(module.parallel_dims))
        return ShardLayout([shard for shard, _ in ranks], ranks[0][1], module.updates_per_batch)

    def teardown(self, stage: str) -> None:
        """Write the queued trajectory logs; stop the environment's worker processes, if it has any."""
        if self.trajectory_log is not None:
            self.trajectory_log.close()
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
        updates = trainer.lightning_module.updates_per_batch
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
        while len(chosen) < self.data.tasks_per_step:
            order = list(range(len(self.tasks)))
            random.Random(self.seed + self.sampler_state["epoch"]).shuffle(order)
            take = order[
                self.sampler_state["position"] : self.sampler_state["position"] + self.data.tasks_per_step - len(chosen)
            ]
            chosen += [self.tasks[i] for i in take]
            self.sampler_state["position"] += len(take)
            if self.sampler_state["position"] >= len(self.tasks):
                self.sampler_state = {"epoch": self.sampler_state["epoch"] + 1, "position": 0}
        return chosen

    def next_batch(self) -> RolloutBatch:
        a = self.algorithm
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
            self.env.max_concurrent_episodes,
            f"rollout step {self.step}",
        )
        groups = same_task_groups(trajectories, sizes)
        survivors, advantages = score_groups(groups, a.reward, a.quarantine_as_failure, a.advantage_std)
        stats = StepStats.of(groups, a.reward)
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
