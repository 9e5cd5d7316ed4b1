"""The environment protocol: tasks, episodes, and how an episode ends (Section 3.1, Appendix G)."""

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Task:
    """One verifiable task q. `tier` is its difficulty (1 = easiest); `scenario` groups tasks for SGC."""

    task_id: str
    tier: int
    scenario: str
    spec: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Verdict:
    """Result of the task's unit tests U(q): `passed` of `total` tests passed. `outcome` names how the episode
    ended where an environment distinguishes (SWE-bench: resolved, unresolved, no_submission, ...); `fixed_reward`
    overrides both reward kinds for endings that leave nothing to test (Table A3's -0.2). `tamper` says what the
    grader did with a submission that changed how its tests run (`restored` them, or `rejected` it untested), and
    `tampered` names what it changed. A verifier that scores instead of testing gives `score` (`from_score`)."""

    passed: int
    total: int
    outcome: str = ""
    fixed_reward: float | None = None
    tamper: str = ""
    tampered: tuple[str, ...] = ()
    score: float | None = None

    @classmethod
    def from_score(cls, score: float, solved_at: float = 1.0, outcome: str = "") -> "Verdict":
        """A float verifier's verdict (reasoning-gym's `score_answer`, a judge in [0, 1]): one test, passed when the
        score reaches `solved_at`, so the sparse reward (Eq. 2) and success are `score >= solved_at`; the dense
        reward (Eq. 1) is the score itself."""
        score = float(score)
        if not 0.0 <= score <= 1.0:  # NaN fails this too
            raise ValueError(f"a verifier's score must lie in [0, 1], got {score!r}: rescale it in the environment")
        return cls(passed=int(score >= solved_at), total=1, outcome=outcome, score=score)

    @property
    def success(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def reward(self, kind: str) -> float:
        """Sparse (Eq. 2) or dense pass-fraction (Eq. 1) reward, unless the ending fixes it."""
        if kind not in ("sparse", "dense"):
            raise ValueError(f"unknown reward {kind!r}: use 'sparse' or 'dense'")
        if self.fixed_reward is not None:
            return self.fixed_reward
        if kind == "sparse":
            return float(self.success)
        if self.score is not None:
            return self.score
        return self.passed / self.total if self.total else 0.0


@dataclass(frozen=True)
class StepResult:
    """What the environment returns for one action: the observation text, whether the episode is over, and whether
    the action was a valid action for the environment at all (`valid`: its own format rule, e.g. one code block;
    format health, `health/invalid_action_frac`). An invalid action is an observation, not an ending."""

    observation: str
    done: bool
    valid: bool = True


class Episode(Protocol):
    """One live episode of one task; concurrent episodes never share state."""

    def messages(self) -> list[dict]:
        """The opening chat messages (system and user) for the policy."""

    def step(self, action_text: str) -> StepResult:
        """Execute the policy's action and return the feedback."""

    def verdict(self) -> Verdict:
        """Run the task's unit tests on the final state."""

    def close(self) -> None:
        """Release the episode's resources."""


class Environment(Protocol):
    """A source of tasks and their episodes. Every member is required: Canopy reads them without probing
    (`tests/test_env_protocol.py` checks that each of its environments declares all of them)."""

    name: str
    max_concurrent_episodes: int | None
    """How many episodes may run at once, and how. None: in-process, no cap (every job at once unless the loop is
    given a `concurrency`); with a batch-at-a-time engine the agent loop drives the episodes in its own thread, one
    batch of every live episode's request per turn. N: at most N at once (a pool's workers), each episode's loop in
    a thread of its own; the systematic-fault check (`check_systemic_faults`) counts N workers."""

    def tasks(self, split: str) -> list[Task]:
        """The task pool of a split (train / dev / test ...)."""

    def start(self, task: Task, seed: int) -> Episode:
        """Begin a fresh, isolated episode of `task`."""

    def close(self) -> None:
        """Release what the environment holds between episodes (a pool's workers, a cluster's actors, a server); a
        no-op for one that holds nothing. The environment may be used again after it (a pool restarts its
        workers on first use)."""


CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def extract_code(action_text: str) -> str | None:
    """The code of a reply's last ```python``` block (reasoning may quote earlier code), or None."""
    blocks = CODE_BLOCK.findall(action_text)
    return blocks[-1] if blocks else None


class EnvironmentFault(RuntimeError):
    """A fault the serving layer attributes to itself (dead worker, infra request failure, cross-episode
    corruption). The episode is quarantined: removed from its group before scoring (Appendix G).
    `worker` is the pool slot it happened on, when a pool served the episode."""

    def __init__(self, reason: str, detail: str = "", worker: int | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail, self.worker = reason, detail, worker

    def __reduce__(self):  # crosses the worker channel with its fields
        return type(self), (self.reason, self.detail, self.worker)


class SystemicFaultError(RuntimeError):
    """The serving layer fails systematically (a broken environment setup, not a rare fault): quarantine would
    hide it, so the run stops with this one-line cause (`canopy.rollout.faults`, `EnvironmentPool`)."""


def keep_fault_log(log: Path, name: str, folder: Path | None = None) -> Path | None:
    """A copy of a faulted process's log, as `name`, where it outlives the process and its worker: `folder`, else
    `$CANOPY_FAULT_LOG_DIR` (the pool sets it for its workers: the run's `env_logs/`), else `<tmp>/canopy-fault-logs`.
    None when there is no log."""
    if not log.is_file():
        return None
    folder = Path(folder or os.environ.get("CANOPY_FAULT_LOG_DIR") or Path(tempfile.gettempdir()) / "canopy-fault-logs")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(log, folder / name)
    return folder / name


def last_line(text: str) -> str:
    """The last non-empty line of a log (where a traceback names its exception)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


class AgentFailure(RuntimeError):
    """An ending the agent caused without a verdict (its own crash, memory blow-up, infinite loop): scored 0."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail
