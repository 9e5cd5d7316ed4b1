"""The embedded environment: a small multi-turn "vault" world that runs in-process on a laptop CPU.

An agent must bring a vault to a goal state through a chain of four actions, each of which needs the
previous ones: `login` -> `key` (take the key) -> `unlock` -> `open`. Every action toggles its effect, so
blindly repeating a fixed script undoes progress: the agent has to read the feedback, which always ends
with `status : <word>` naming the first unmet prerequisite. The tier of a task is the number of chain steps
its goal still needs (1, 2 or 3); its unit tests are one state check per goal step, so the sparse reward is
"all checks pass" (Eq. 2) and the dense reward is the pass fraction (Eq. 1). The episode ends as soon as every
check passes, or when the agent runs out of turns or tokens.

With `env.fault_rate` = r > 0 (Appendix G's sensitivity check), each action fails in the serving layer with
probability r, as a worker dying under a step would: `EnvironmentFault("injected_fault")`, so the episode is
quarantined. Whether a given turn fails is fixed by (task, episode seed, turn), so a run repeats exactly and two
variants that sample alike meet the same faults. A longer episode meets more of them, as on a real cluster.
"""

import hashlib
from dataclasses import dataclass

from canopy.envs.base import EnvironmentFault, StepResult, Task, Verdict

ACTIONS = ("login", "key", "unlock", "open")
STATUS_WORDS = ("guest", "keyless", "locked", "shut")  # the first unmet step, in chain order
GOAL_TEXT = ("signed in", "key held", "vault unlocked", "vault open")
SYSTEM_PROMPT = "you operate a vault . reply with one command : login key unlock open"

# Every word the environment prints, so a tiny word-level tokenizer can cover it exactly.
VOCABULARY = sorted(
    set(SYSTEM_PROMPT.split())
    | set(ACTIONS)
    | set(STATUS_WORDS)
    | {w for text in GOAL_TEXT for w in text.split()}
    | {"task", "goal", "status", "ok", "error", "no", "command", "done", "vault", "."}
    | {str(d) for d in range(10)}
)

SPLIT_VAULT_IDS = {"train": range(0, 6), "dev": range(6, 8), "test": range(8, 10)}


def make_tasks(split: str) -> list[Task]:
    """All (start, goal) structures of each tier, one task per vault id of the split."""
    if split not in SPLIT_VAULT_IDS:
        raise ValueError(f"unknown split {split!r} for the embedded environment: use one of {list(SPLIT_VAULT_IDS)}")
    tasks = []
    for vault in SPLIT_VAULT_IDS[split]:
        for start in range(len(ACTIONS)):
            for tier in (1, 2, 3):
                if start + tier <= len(ACTIONS):
                    tasks.append(
                        Task(
                            task_id=f"vault{vault}_s{start}_t{tier}",
                            tier=tier,
                            scenario=f"vault{vault}",
                            spec={"vault": vault, "start": start, "goal_end": start + tier},
                        )
                    )
    return tasks


@dataclass
class VaultEpisode:
    """One isolated episode: `done[j]` is whether chain step j currently holds."""

    task: Task
    seed: int = 0
    fault_rate: float = 0.0

    def __post_init__(self):
        self.start, self.goal_end = self.task.spec["start"], self.task.spec["goal_end"]
        self.done = [j < self.start for j in range(len(ACTIONS))]
        self.turn = 0

    def _status(self) -> str:
        for j in range(self.goal_end):
            if not self.done[j]:
                return STATUS_WORDS[j]
        return "done"

    def _checks(self) -> list[bool]:
        return [self.done[j] for j in range(self.start, self.goal_end)]

    def messages(self) -> list[dict]:
        goal = GOAL_TEXT[self.goal_end - 1]
        user = f"task : vault {self.task.spec['vault']} . goal : {goal} . status : {self._status()}"
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        if self.fault_rate and injected_fault(self.task.task_id, self.seed, self.turn) < self.fault_rate:
            raise EnvironmentFault("injected_fault", f"env.fault_rate={self.fault_rate} at turn {self.turn}")
        command = next((word for word in action_text.split() if word in ACTIONS), None)
        if command is None:
            return StepResult(f"error : no command . status : {self._status()}", done=False)
        j = ACTIONS.index(command)
        unmet = next((i for i in range(j) if not self.done[i]), None)
        if unmet is not None:
            return StepResult(f"error : {command} . status : {STATUS_WORDS[unmet]}", done=False)
        self.done[j] = not self.done[j]
        finished = all(self._checks())
        return StepResult(f"ok : {command} . status : {self._status()}", done=finished)

    def verdict(self) -> Verdict:
        checks = self._checks()
        return Verdict(passed=sum(checks), total=len(checks))

    def close(self) -> None:
        pass


def injected_fault(task_id: str, seed: int, turn: int) -> float:
    """A uniform draw in [0, 1) fixed by the episode's task, seed and turn: the turn fails below the fault rate."""
    digest = hashlib.blake2b(f"{task_id}/{seed}/{turn}".encode(), digest_size=8).digest()  # not crc32: linear,
    return int.from_bytes(digest, "big") / 2**64  # its draws for neighbouring turns are far from independent


class EmbeddedEnvironment:
    """In-process vault world; deterministic, so `seed` only names the episode (and places its injected faults)."""

    name = "embedded"

    def __init__(self, fault_rate: float = 0.0):
        self.fault_rate = fault_rate

    def tasks(self, split: str) -> list[Task]:
        return make_tasks(split)

    def start(self, task: Task, seed: int) -> VaultEpisode:
        return VaultEpisode(task, seed, self.fault_rate)


def environment_kwargs(env) -> dict:
    """`env.fault_rate`: the probability that an action fails in the serving layer (0 = never)."""
    from canopy.config import ConfigError

    rate = env.get("fault_rate", 0.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ConfigError(f"env.fault_rate={rate} must be a probability in [0, 1): e.g. env.fault_rate=0.03")
    return {"fault_rate": float(rate)}


ENVIRONMENT = EmbeddedEnvironment
