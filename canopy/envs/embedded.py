"""The embedded environment: a small multi-turn "vault" world that runs in-process on a laptop CPU.

An agent must bring a vault to a goal state through a chain of four actions, each of which needs the
previous ones: `login` -> `key` (take the key) -> `unlock` -> `open`. Every action toggles its effect, so
blindly repeating a fixed script undoes progress: the agent has to read the feedback, which always ends
with `status : <word>` naming the first unmet prerequisite. The tier of a task is the number of chain steps
its goal still needs (1, 2 or 3); its unit tests are one state check per goal step, so the sparse reward is
"all checks pass" (Eq. 2) and the dense reward is the pass fraction (Eq. 1). The episode ends as soon as every
check passes, or when the agent runs out of turns or tokens.
"""

from dataclasses import dataclass

from canopy.envs.base import StepResult, Task, Verdict

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

    def __post_init__(self):
        self.start, self.goal_end = self.task.spec["start"], self.task.spec["goal_end"]
        self.done = [j < self.start for j in range(len(ACTIONS))]

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


class EmbeddedEnvironment:
    """In-process vault world; deterministic, so `seed` only names the episode."""

    name = "embedded"

    def tasks(self, split: str) -> list[Task]:
        return make_tasks(split)

    def start(self, task: Task, seed: int) -> VaultEpisode:
        return VaultEpisode(task)


ENVIRONMENT = EmbeddedEnvironment
