"""A finished episode (Sec. 3.1): its token ids, action mask and engine logprobs, and how it ended (Sec. 3.2;
quarantine, Appendix G); and the format-health rates of its actions."""

from dataclasses import dataclass, field

from canopy.envs.base import EnvironmentFault, Task, Verdict
from canopy.rollout.engine import EngineFault


@dataclass
class Trajectory:
    """One finished episode. Exactly one of `verdict`, `agent_failure`, `quarantine` describes its outcome."""

    task: Task
    sample_index: int
    token_ids: list[int]
    action_mask: list[int]
    engine_logprobs: list[float]  # aligned with token_ids; 0.0 where action_mask is 0
    prompt_length: int
    token_versions: list[int] = field(default_factory=list)  # aligned: the weight version that sampled it, else -1
    num_turns: int = 0
    response_tokens: int = 0
    actions: int = 0  # actions the environment answered (a `StepResult`)
    invalid_turns: list[int] = field(default_factory=list)  # the turns (from 1) whose action was invalid for it
    ending: str = ""  # done | turn_limit | token_budget | context_limit | agent_failure | quarantined
    verdict: Verdict | None = None
    agent_failure: str | None = None
    quarantine: str | None = None
    fault: EnvironmentFault | EngineFault | None = None  # the serving-layer fault behind `quarantine`

    def quarantine_for(self, fault: EnvironmentFault | EngineFault) -> str:
        """Mark the episode quarantined by `fault` (Appendix G); returns its ending."""
        self.ending, self.quarantine, self.fault = "quarantined", fault.reason, fault
        return self.ending

    @property
    def weight_versions(self) -> set[int]:
        """The weight versions its tokens were sampled with (one, when strictly on-policy)."""
        return set(self.token_versions) - {-1}

    @property
    def truncated(self) -> bool:
        return self.ending in ("token_budget", "context_limit")

    def reward(self, kind: str) -> float:
        """Scored outcome; agent failures score 0. Quarantined episodes have no reward (see `quarantine`)."""
        if self.quarantine is not None:
            raise ValueError(f"episode {self.task.task_id}#{self.sample_index} is quarantined and has no reward")
        return self.verdict.reward(kind) if self.verdict is not None else 0.0


def invalid_action_fracs(actions_by_tier: dict[int, list[int]]) -> dict[str, float]:
    """Format health from {tier: [invalid actions, actions answered]}: {"all" | "tier<K>": invalid / answered},
    where any action was answered (the training step's log, evaluations and the end-of-run summary)."""
    total = [sum(counts[i] for counts in actions_by_tier.values()) for i in (0, 1)]
    rows = [("all", total), *((f"tier{tier}", counts) for tier, counts in sorted(actions_by_tier.items()))]
    return {name: invalid / answered for name, (invalid, answered) in rows if answered}
