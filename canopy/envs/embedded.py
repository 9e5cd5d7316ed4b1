"""The embedded environment: a small multi-turn "vault" world that runs in-process on a laptop CPU.

An agent must bring a vault to a goal state through a chain of four actions, each of which needs the
previous ones: `login` -> `key` (take the key) -> `unlock` -> `open`. Every action toggles its effect, so
blindly repeating a fixed script undoes progress: the agent has to read the feedback, which always ends
with `status : <word>` naming the first unmet prerequisite. The tier of a task is the number of chain steps
its goal still needs (1, 2 or 3); its unit tests are one state check per goal step, so the sparse reward is
"all checks pass" (Eq. 2) and the dense reward is the pass fraction (Eq. 1). The episode ends as soon as every
check passes, or when the agent runs out of turns or tokens. A reply that holds no command word is an unknown
command, the world's invalid action (`StepResult.valid`); a known command whose prerequisite is unmet is valid.

With `env.declare_done` (the paper-checks testbed, `experiment=testbed`), tasks differ: the status names the first
unmet step of the whole chain, not of the task's goal, and the episode ends only when the agent says `done` (or
runs out of turns, which fails the task, as a missing submission fails on SWE-bench). The same status then calls
for different replies in different tasks (`locked` means `unlock` when the goal is an open vault, and `done` when
it is a held key), and a step past the goal fails the task, as an agent that keeps editing after its fix breaks
it. The hardest tier is starved at small groups.

With `env.fault_rate` = r > 0 (Appendix G's sensitivity check), each action fails in the serving layer with
probability r, as a worker dying under a step would: `EnvironmentFault("injected_fault")`, so the episode is
quarantined. Whether a given turn fails is fixed by (task, episode seed, turn), so a run repeats exactly and two
variants that sample alike meet the same faults. A longer episode meets more of them, as on a real cluster.
"""

import hashlib
from dataclasses import dataclass

from canopy.envs.base import EnvironmentFault, StepResult, Task, Verdict
from canopy.errors import ConfigError

ACTIONS = ("login", "key", "unlock", "open")
STATUS_WORDS = ("guest", "keyless", "locked", "shut")  # the first unmet step, in chain order
GOAL_TEXT = ("signed in", "key held", "vault unlocked", "vault open")
SYSTEM_PROMPT = "you operate a vault . reply with one command : login key unlock open"
DECLARE_DONE_PROMPT = SYSTEM_PROMPT + " done"
FINISH = "done"  # the command that ends an episode under `declare_done`

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
    declare_done: bool = False

    def __post_init__(self):
        self.start, self.goal_end = self.task.spec["start"], self.task.spec["goal_end"]
        self.done = [j < self.start for j in range(len(ACTIONS))]
        self.turn = 0
        self.declared = False  # whether the agent said `done` (declare_done: an episode that never does fails)

    def _status(self) -> str:
        """The first unmet step up to the goal; under `declare_done`, of the whole chain ("ok" once it all holds)."""
        horizon = len(ACTIONS) if self.declare_done else self.goal_end
        for j in range(horizon):
            if not self.done[j]:
                return STATUS_WORDS[j]
        return "ok" if self.declare_done else "done"

    def _checks(self) -> list[bool]:
        """One check per goal step; under `declare_done`, one more that no step past the goal was taken, and one
        that the agent said `done`, as a SWE-bench agent that never submits fails however good its edits."""
        checks = [self.done[j] for j in range(self.start, self.goal_end)]
        if self.declare_done and self.goal_end < len(ACTIONS):
            checks.append(not any(self.done[self.goal_end :]))
        if self.declare_done:
            checks.append(self.declared)
        return checks

    def _state_line(self, status: str | None = None) -> str:
        """The line that ends every observation; under `declare_done` it restates the goal, as the prompt does."""
        status = status or self._status()
        if self.declare_done:
            return f"goal : {GOAL_TEXT[self.goal_end - 1]} . status : {status}"
        return f"status : {status}"

    def messages(self) -> list[dict]:
        goal = GOAL_TEXT[self.goal_end - 1]
        user = f"task : vault {self.task.spec['vault']} . goal : {goal} . status : {self._status()}"
        system = DECLARE_DONE_PROMPT if self.declare_done else SYSTEM_PROMPT
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        if self.fault_rate and injected_fault(self.task.task_id, self.seed, self.turn) < self.fault_rate:
            raise EnvironmentFault("injected_fault", f"env.fault_rate={self.fault_rate} at turn {self.turn}")
        commands = ACTIONS + (FINISH,) if self.declare_done else ACTIONS
        words = action_text.split()  # the first command word counts; under declare_done the last, since the
        # reply may restate the goal, whose words include `open`
        command = next((word for word in (words[::-1] if self.declare_done else words) if word in commands), None)
        if command is None:  # an unknown command: the one invalid action of this world
            return StepResult(f"error : no command . {self._state_line()}", done=False, valid=False)
        if command == FINISH:
            self.declared = True
            return StepResult(f"ok : done . {self._state_line()}", done=True)
        j = ACTIONS.index(command)
        unmet = next((i for i in range(j) if not self.done[i]), None)
        if unmet is not None:
            return StepResult(f"error : {command} . {self._state_line(STATUS_WORDS[unmet])}", done=False)
        self.done[j] = not self.done[j]
        finished = not self.declare_done and all(self._checks())
        return StepResult(f"ok : {command} . {self._state_line()}", done=finished)

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
    max_concurrent_episodes: int | None = None  # in-process

    def __init__(self, fault_rate: float = 0.0, declare_done: bool = False):
        self.fault_rate = fault_rate
        self.declare_done = declare_done

    def tasks(self, split: str) -> list[Task]:
        return make_tasks(split)

    def start(self, task: Task, seed: int) -> VaultEpisode:
        return VaultEpisode(task, seed, self.fault_rate, self.declare_done)

    def close(self) -> None:
        """Nothing is held between episodes."""


def environment_kwargs(env) -> dict:
    """`env.fault_rate`: the probability that an action fails in the serving layer (0 = never);
    `env.declare_done`: the testbed's rule (the agent ends the episode; the status covers the whole chain)."""

    rate = env.get("fault_rate", 0.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ConfigError(f"env.fault_rate={rate} must be a probability in [0, 1): e.g. env.fault_rate=0.03")
    declare_done = env.get("declare_done", False)
    if not isinstance(declare_done, bool):
        raise ConfigError(f"env.declare_done={declare_done!r} must be true or false")
    return {"fault_rate": float(rate), "declare_done": declare_done}


ENVIRONMENT = EmbeddedEnvironment
