"""One rollout step, from episodes to the trainer's batch: same-task groups (Sec. 3.1), quarantine then reward then
Eq. 3 over them (`score_groups`, App. G's order), the step's statistics for the logs and callbacks (`StepStats`),
the adaptive group sizes (Eq. 4 summed, beyond the paper) and the padded `RolloutBatch` the module learns from."""

import functools
import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from canopy.coverage import AdaptiveGroupSettings, SuccessEstimates, allocate_rollouts, group_composition
from canopy.envs.base import Task
from canopy.objective import step_advantages
from canopy.rollout.trajectory import Trajectory, invalid_action_fracs

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

    def __init__(self, rollouts_per_step: int, settings: AdaptiveGroupSettings):
        self.rollouts_per_step, self.floor, self.cap = rollouts_per_step, settings.floor, settings.cap
        self.estimates = SuccessEstimates(settings.decay)

    def sizes(self, tasks: list[Task]) -> list[int]:
        rates = [self.estimates.rate(t.task_id, t.tier) for t in tasks]
        return allocate_rollouts(rates, self.rollouts_per_step, self.floor, self.cap)

    def observe(self, groups: list[Group]) -> None:
        """Each group's scored outcomes (quarantined episodes left out) update its task's estimate."""
        for group in groups:
            self.estimates.observe(group.task.task_id, group.task.tier, group.successes, len(group.scored))


@dataclass
class RolloutBatch:
    """Right-padded sequences of the surviving (non-quarantined) episodes of one step.

    `action_mask[b, t]` is 1 where token t was generated by the policy, `token_versions[b, t]` the weight version
    of the engine that sampled it (-1 off the action tokens); `advantages[b]` is the group-standardized advantage
    of episode b. `metrics` is what the step logs of its rollout: `stats.metrics`, phase timings, engine counts.
    """

    input_ids: torch.Tensor  # [B, T] long
    action_mask: torch.Tensor  # [B, T] bool
    engine_logprobs: torch.Tensor  # [B, T] float, 0 off the action tokens
    token_versions: torch.Tensor  # [B, T] long, -1 off the action tokens
    advantages: torch.Tensor  # [B]
    lengths: torch.Tensor  # [B]
    metrics: dict[str, float]
    stats: StepStats | None = None  # the step's statistics, which the callbacks read (whole batches only)

    @property
    def num_action_tokens(self) -> int:
        """N of Eq. 8, pooled over the whole batch (quarantined episodes already removed)."""
        return int(self.action_mask[:, 1:].sum())

    def micro_batches(self, max_tokens: int) -> list[torch.Tensor]:
        """Index groups, by length, each at most `max_tokens` padded tokens (gradient accumulation only)."""
        order = torch.argsort(self.lengths, descending=True).tolist()
        groups, current = [], []
        for index in order:
            width = int(self.lengths[current[0]]) if current else int(self.lengths[index])
            if current and width * (len(current) + 1) > max_tokens:
                groups.append(torch.tensor(current))
                current = []
            current.append(index)
        if current:
            groups.append(torch.tensor(current))
        return groups

    def to(self, device: torch.device) -> "RolloutBatch":
        """The batch's tensors on `device` (the same ones where they already are); its metrics and stats as they are,
        unwalked (Lightning's `move_data_to_device` would walk every episode of `stats`)."""
        tensors = (self.input_ids, self.action_mask, self.engine_logprobs, self.token_versions, self.advantages)
        return RolloutBatch(*(t.to(device) for t in (*tensors, self.lengths)), self.metrics, self.stats)

    def select(self, indices: torch.Tensor) -> "RolloutBatch":
        """A sub-batch (minibatch / micro-batch), trimmed to its own longest sequence."""
        width = int(self.lengths[indices].max())
        return RolloutBatch(
            self.input_ids[indices, :width],
            self.action_mask[indices, :width],
            self.engine_logprobs[indices, :width],
            self.token_versions[indices, :width],
            self.advantages[indices],
            self.lengths[indices],
            {},
        )


def pack(trajectories: list[Trajectory], advantages: torch.Tensor, pad_token_id: int) -> RolloutBatch:
    """The survivors right-padded into one `RolloutBatch`, each token with its weight version, in their order: every
    field filled from one flat list through the mask of real positions (row-major, as the rows are laid out)."""
    lengths = torch.tensor([len(t.token_ids) for t in trajectories], dtype=torch.long)
    width = int(lengths.max()) if len(trajectories) else 1
    real = torch.arange(width) < lengths[:, None]

    def padded(rows: list[list], fill, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((len(rows), width), fill, dtype=dtype)
        out[real] = torch.tensor([x for row in rows for x in row], dtype=dtype)
        return out

    return RolloutBatch(
        padded([t.token_ids for t in trajectories], pad_token_id, torch.long),
        padded([t.action_mask for t in trajectories], False, torch.bool),
        padded([t.engine_logprobs for t in trajectories], 0.0, torch.float32),
        padded([t.token_versions for t in trajectories], -1, torch.long),
        advantages,
        lengths,
        {},
    )
