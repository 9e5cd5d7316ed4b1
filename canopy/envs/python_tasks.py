"""A small code-executing environment: the agent answers in ```python``` blocks run in the sandbox.

Each task asks for a value to be computed and handed in with `submit(value)`, a helper prepended to every
action, which writes `answer.txt` in the episode's scratch directory and ends the episode. The task's unit
tests check that an answer exists and that it is right (sparse: both; dense: the pass fraction). A reply without
a code block is an invalid action (`StepResult.valid`). Exceptions and syntax errors come back as the observation;
an action that breaks a sandbox limit or crashes its own process ends the episode as the agent's failure. Tiers:
1 = write a given number, 2 = a sum over a range, 3 = a sorted, comma-joined word list.

Before every step the episode checks that its scratch directory still carries its own identity (written
where the sandboxed code cannot write): a mismatch is cross-episode corruption, a serving-layer fault. After every
step and before the verdict it checks that the scratch filesystem has room: one filled by another tenant while the
policy's folders hold little of it (`canopy.envs.attribution.full_scratch`) failed the agent's writes, and
quarantines the episode (`scratch_full`); one the policy filled itself is its own doing.

What the agent's code can and cannot touch (issue 28, tests/test_python_tasks_integrity.py):
- It can write anything in its own scratch directory, `answer.txt` and `.submitted` included, and redefine
  `submit`: the verdict reads only what `answer.txt` holds when the episode ends. An answer that is not a
  regular file it can open and read (a symlink, FIFO, socket, directory, unreadable file) counts as no answer;
  only the first `MAX_ANSWER_BYTES` are read. Any exit status is its own: an exit, even with the runner's
  setup-failure status, is an ordinary error; a signal or a broken limit is its failure (scored 0), never a quarantine.
- It cannot write outside its scratch directory (the `identity` file, /tmp, other episodes' directories:
  Landlock), signal or trace the worker, or leave a process running past its step (when run as root, every
  process of the sandbox uid is killed; see `canopy.envs.sandbox`). The expected answer lives only in the
  worker's memory (and in `make_tasks`, which only restates what the prompt asks).
- It cannot read other episodes' answers: the episode directories sit in a folder it cannot list, under random
  names, and each scratch directory is private to its sandbox uid (one per pool worker, so a path seen in
  another worker's /proc/<pid>/cmdline does not help; in-process episodes share a uid but run their sandboxes
  one at a time). Without root (one uid for everything, in a user namespace) file modes protect nothing and
  processes can outlive their step: run code-executing environments as root.
"""

import os
import random
import stat
import uuid
from pathlib import Path

from canopy.envs.attribution import policy_folders, scratch_fault, scratch_root
from canopy.envs.base import AgentFailure, EnvironmentFault, StepResult, Task, Verdict, extract_code
from canopy.envs.isolation.base import remove_tree
from canopy.envs.sandbox import SandboxLimits, prepare_scratch, run_sandboxed

SYSTEM_PROMPT = "Solve the task with Python. Reply with one ```python``` block; call submit(value) with the answer."
PRELUDE = "def submit(value):\n    open('answer.txt', 'w').write(str(value))\n    open('.submitted', 'w').close()\n"
SPLIT_SEEDS = {"train": 0, "dev": 1, "test": 2}
MAX_ANSWER_BYTES = 1 << 20  # a verdict reads no more of answer.txt (its size is bounded only by max_file_mb)
POLICY_FOLDERS = ("python_tasks/episode-*/scratch",)  # below a scratch root: where the sandboxed code may write
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
        self.root = scratch_root.parent  # the process's scratch root (POLICY_FOLDERS lie below it)
        self.identity = uuid.uuid4().hex
        scratch_root.mkdir(parents=True, exist_ok=True)
        scratch_root.chmod(0o711)  # unlistable: other episodes' code cannot find this episode's directory
        self.home = scratch_root / f"episode-{self.identity}"
        self.home.mkdir(mode=0o711)
        (self.home / "identity").write_text(self.identity)
        self.scratch = prepare_scratch(self.home / "scratch")
        self.scratch.chmod(0o700)  # readable by its own sandbox uid only, not by other workers' sandboxes

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
            return StepResult("No ```python``` block found. Reply with one code block.", done=False, valid=False)
        result = run_sandboxed(PRELUDE + code, self.scratch, self.limits)
        self._check_scratch()
        if result.agent_fault:
            raise AgentFailure(f"agent_{result.status}", result.output[-200:])
        done = os.path.exists(self.scratch / ".submitted")  # False, not an error, if the code made it unreadable
        observation = result.output[: self.max_observation_chars] or "(no output)"
        return StepResult(observation, done=done)

    def _check_scratch(self) -> None:
        """A scratch filesystem filled by another tenant (`attribution.full_scratch`) fails the agent's writes:
        the serving layer's fault."""
        fault = scratch_fault(self.scratch, lambda: policy_folders(self.root, POLICY_FOLDERS))
        if fault is not None:
            raise fault

    def verdict(self) -> Verdict:
        self._check_identity()
        self._check_scratch()
        answer = self._answer()
        exists = answer is not None
        correct = exists and answer.strip() == self.task.spec["answer"]
        return Verdict(passed=int(exists) + int(correct), total=2)

    def _answer(self) -> str | None:
        """What `answer.txt` holds, or None unless it is a regular file the verdict can open and read. It is opened
        once, without following a symlink or waiting (on a FIFO, a lease), and checked on the open descriptor, so a
        process that swaps the path meanwhile cannot make the verdict judge another file or hang. Every error opening
        or reading it is no answer: the file is the agent's, whatever it made of it (a symlink, a socket, a FIFO, a
        directory, no permission), and an error that raised here would quarantine the episode."""
        try:
            fd = os.open(self.scratch / "answer.txt", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return os.read(fd, MAX_ANSWER_BYTES).decode(errors="replace")
        except OSError:
            return None
        finally:
            os.close(fd)

    def close(self) -> None:
        remove_tree(self.home)


class PythonTaskEnvironment:
    name = "python_tasks"
    max_concurrent_episodes: int | None = None  # in-process; a pool of them declares its workers

    def __init__(self, sandbox: dict | None = None, max_observation_chars: int = 2000, tasks_per_tier: int = 10):
        self.limits = SandboxLimits(**(sandbox or {}))
        self.max_observation_chars, self.tasks_per_tier = max_observation_chars, tasks_per_tier
        self.scratch_root = scratch_root("canopy-scratch") / "python_tasks"  # a folder of its own: episodes chmod it

    def tasks(self, split: str) -> list[Task]:
        return make_tasks(split, self.tasks_per_tier)

    def start(self, task: Task, seed: int) -> PythonTaskEpisode:
        return PythonTaskEpisode(task, self.scratch_root, self.limits, self.max_observation_chars)

    def close(self) -> None:
        """Nothing is held between episodes (each episode removes its own scratch folder)."""


ENVIRONMENT = PythonTaskEnvironment


def environment_kwargs(env) -> dict:
    """The sandbox limits (`env.sandbox.*`, checked with the serving layer's keys)."""
    return {"sandbox": {key: env.sandbox[key] for key in env.sandbox}}
