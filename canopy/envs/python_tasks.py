"""A small code-executing environment: the agent answers in ```python``` blocks run in the sandbox.

Each task asks for a value to be computed and handed in with `submit(value)`, a helper prepended to every
action, which writes `answer.txt` in the episode's scratch directory and ends the episode. The task's unit
tests check that an answer exists and that it is right (sparse: both; dense: the pass fraction). Exceptions
and syntax errors come back as the observation; an action that breaks a sandbox limit or crashes its own
process ends the episode as the agent's failure. Tiers: 1 = write a given number, 2 = a sum over a range,
3 = a sorted, comma-joined word list.

Before every step the episode checks that its scratch directory still carries its own identity (written
where the sandboxed code cannot write): a mismatch is cross-episode corruption, a serving-layer fault.
"""

import os
import random
import shutil
import tempfile
import uuid
from pathlib import Path

from canopy.envs.base import AgentFailure, EnvironmentFault, StepResult, Task, Verdict, extract_code
from canopy.envs.sandbox import SandboxLimits, prepare_scratch, run_sandboxed

SYSTEM_PROMPT = "Solve the task with Python. Reply with one ```python``` block; call submit(value) with the answer."
PRELUDE = "def submit(value):\n    open('answer.txt', 'w').write(str(value))\n    open('.submitted', 'w').close()\n"
SPLIT_SEEDS = {"train": 0, "dev": 1, "test": 2}
WORDS = ("pine", "oak", "fern", "moss", "elm", "ash", "yew", "fir", "ivy", "reed")


def make_tasks(split: str, per_tier: int = 10) -> list[Task]:
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r} for the python tasks: use one of {list(SPLIT_SEEDS)}")
    rng = random.Random(SPLIT_SEEDS[split])
    tasks = []
    for i in range(per_tier):
        number = rng.randrange(1000)
        low, high = sorted(rng.sample(range(200), 2))
        words = rng.sample(WORDS, 4)
        specs = [
            (f"Submit the number {number}.", str(number)),
            (f"Submit the sum of the integers from {low} to {high} inclusive.", str(sum(range(low, high + 1)))),
            (
                f"Submit the words {' '.join(words)} sorted alphabetically and joined by commas.",
                ",".join(sorted(words)),
            ),
        ]
        for tier, (prompt, answer) in enumerate(specs, start=1):
            tasks.append(Task(f"{split}{i}_t{tier}", tier, f"{split}{i}", {"prompt": prompt, "answer": answer}))
    return tasks


class PythonTaskEpisode:
    def __init__(self, task: Task, scratch_root: Path, limits: SandboxLimits, max_observation_chars: int):
        self.task, self.limits, self.max_observation_chars = task, limits, max_observation_chars
        self.identity = uuid.uuid4().hex
        self.home = scratch_root / f"episode-{self.identity}"
        self.home.mkdir(parents=True)
        (self.home / "identity").write_text(self.identity)
        self.scratch = prepare_scratch(self.home / "scratch")

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.task.spec["prompt"]}]

    def _check_identity(self) -> None:
        found = (self.home / "identity").read_text() if (self.home / "identity").is_file() else None
        if found != self.identity:
            raise EnvironmentFault("cross_episode_corruption", f"scratch of {self.task.task_id} holds state of {found}")

    def step(self, action_text: str) -> StepResult:
        self._check_identity()
        code = extract_code(action_text)
        if code is None:
            return StepResult("No ```python``` block found. Reply with one code block.", done=False)
        result = run_sandboxed(PRELUDE + code, self.scratch, self.limits)
        if result.agent_fault:
            raise AgentFailure(f"agent_{result.status}", result.output[-200:])
        done = (self.scratch / ".submitted").exists()
        observation = result.output[: self.max_observation_chars] or "(no output)"
        return StepResult(observation, done=done)

    def verdict(self) -> Verdict:
        self._check_identity()
        answer_file = self.scratch / "answer.txt"
        exists = answer_file.is_file() and not answer_file.is_symlink()
        correct = exists and answer_file.read_text(errors="replace").strip() == self.task.spec["answer"]
        return Verdict(passed=int(exists) + int(correct), total=2)

    def close(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


class PythonTaskEnvironment:
    name = "python_tasks"

    def __init__(self, sandbox: dict | None = None, max_observation_chars: int = 2000, tasks_per_tier: int = 10):
        self.limits = SandboxLimits(**(sandbox or {}))
        self.max_observation_chars, self.tasks_per_tier = max_observation_chars, tasks_per_tier
        self.scratch_root = Path(
            os.environ.get("CANOPY_SCRATCH_ROOT") or Path(tempfile.gettempdir()) / "canopy-scratch"
        )

    def tasks(self, split: str) -> list[Task]:
        return make_tasks(split, self.tasks_per_tier)

    def start(self, task: Task, seed: int) -> PythonTaskEpisode:
        return PythonTaskEpisode(task, self.scratch_root, self.limits, self.max_observation_chars)


ENVIRONMENT = PythonTaskEnvironment


def environment_kwargs(env) -> dict:
    """The sandbox limits (`env.sandbox.*`, checked with the serving layer's keys)."""
    return {"sandbox": {key: env.sandbox[key] for key in env.sandbox}}
