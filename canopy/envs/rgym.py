"""reasoning-gym's procedural task sets (https://github.com/open-thought/reasoning-gym) as one-turn episodes: the
question is the prompt, the reply's `<answer>...</answer>` is handed to the dataset's own `score_answer`, and its
float score is the verdict (`Verdict.from_score`: solved at `env.rgym.solved_at`, the dense reward is the score).

The worked example of an environment from a package (docs/environments.md): an optional extra, `pip install
'canopy[rgym]'`, declared in `env.requires` (conf/env/rgym.yaml), so a machine without it gets one line naming the
install when it chooses `env=rgym` and nothing else changes. The package is imported inside the methods only.

Tasks: `tasks_per_dataset` entries of each dataset in `env.rgym.datasets`, the splits drawn with their own seeds
(procedural sets can repeat an easy question across splits). A task's tier is its dataset's place in the list
(list the easiest first); its scenario is the dataset's name."""

import difflib
import functools
from dataclasses import asdict, dataclass, field

from canopy.envs.base import StepResult, Task, Verdict
from canopy.errors import ConfigError, is_int, require

SYSTEM_PROMPT = "Answer the question. Give your final answer as <answer>...</answer>."
SPLIT_SEEDS = {"train": 0, "dev": 1, "test": 2}


@dataclass(frozen=True)
class RGymSettings:
    """`env.rgym.*` (conf/env/rgym.yaml): the schema and the only defaults of those keys."""

    datasets: list[str] = field(default_factory=lambda: ["basic_arithmetic"])  # reasoning-gym names, easiest first
    tasks_per_dataset: int = 64  # per split
    solved_at: float = 1.0  # a score at or above it solves the task (sparse reward, success)

    def validate(self) -> None:
        import reasoning_gym

        known = sorted(reasoning_gym.factory.DATASETS)
        require(self.datasets, "env.rgym.datasets is empty: name one or more, e.g. [basic_arithmetic]")
        for name in self.datasets:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"e.g. {', '.join(known[:5])}"
            require(name in known, f"env.rgym.datasets: {name!r} is not a reasoning-gym dataset: {hint}")
        require(
            is_int(self.tasks_per_dataset) and self.tasks_per_dataset >= 1,
            f"env.rgym.tasks_per_dataset={self.tasks_per_dataset} must be a positive integer",
        )
        require(0 < self.solved_at <= 1, f"env.rgym.solved_at={self.solved_at} must lie in (0, 1]")


@functools.cache
def dataset(name: str, split: str, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=SPLIT_SEEDS[split])


class RGymEpisode:
    def __init__(self, task: Task, settings: RGymSettings):
        self.task, self.settings = task, settings
        self.data = dataset(task.spec["dataset"], task.spec["split"], settings.tasks_per_dataset)
        self.entry = self.data[task.spec["index"]]
        self.answer: str | None = None

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.entry["question"]}]

    def step(self, action_text: str) -> StepResult:
        from reasoning_gym.utils import extract_answer

        self.answer = extract_answer(action_text)
        if self.answer is None:  # no answer tag: the one invalid action; the episode still ends unanswered
            return StepResult("no <answer>...</answer> in the reply", done=True, valid=False)
        return StepResult("answer received", done=True)

    def verdict(self) -> Verdict:
        return Verdict.from_score(self.data.score_answer(self.answer, self.entry), self.settings.solved_at)

    def close(self) -> None:
        pass


class RGymEnvironment:
    name = "rgym"
    max_concurrent_episodes: int | None = None  # in-process

    def __init__(self, **settings):
        self.settings = RGymSettings(**settings)

    def tasks(self, split: str) -> list[Task]:
        if split not in SPLIT_SEEDS:
            raise ValueError(f"unknown split {split!r} for reasoning-gym: use one of {list(SPLIT_SEEDS)}")
        s = self.settings
        return [
            Task(f"{name}/{split}/{i}", tier, name, {"dataset": name, "split": split, "index": i})
            for tier, name in enumerate(s.datasets, start=1)
            for i in range(s.tasks_per_dataset)
        ]

    def start(self, task: Task, seed: int) -> RGymEpisode:
        return RGymEpisode(task, self.settings)

    def close(self) -> None:
        """Nothing is held between episodes."""


ENVIRONMENT, SETTINGS = RGymEnvironment, RGymSettings


def environment_kwargs(env) -> dict:
    """`env.rgym.*`, checked against reasoning-gym's own dataset names."""
    from omegaconf import OmegaConf

    if "rgym" not in env:
        raise ConfigError("env.rgym is missing: select reasoning-gym with env=rgym (a config group), not env.name")
    settings = RGymSettings(**OmegaConf.to_container(env.rgym, resolve=True))
    settings.validate()
    return asdict(settings)
