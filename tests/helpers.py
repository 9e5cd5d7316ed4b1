"""What several test files share (no test file imports another): the composed config, hand-built trajectories and a
data module over the vault world, Eq. 3 for one group, an environment package from outside the tree, `train.py` runs,
a module's imports, the rendered viewer page, AppWorld's venv and pool settings, SGLang and vLLM engines over fake
servers, an environment of fixed-length episodes, and the run's typed settings with a test's few values replaced
(`section`, `canopy_module`, `datamodule_over`). Fixtures are in conftest.py; the fake servers, the scripted engines
and the rank worker are modules of their own."""

import dataclasses
import functools
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from canopy.envs.base import StepResult, Task, Verdict
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.envs.pool import PoolSettings
from canopy.modules.parallel import ParallelSettings
from canopy.objective import step_advantages
from canopy.rollout.budget import Budget, BudgetSettings
from canopy.rollout.engine import SamplingParams
from canopy.rollout.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]

UNFILTERED = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1)  # temperature 1, no nucleus or top-k filter


def config(*overrides):
    """conf/train.yaml composed with `overrides`, as train.py composes it."""
    from canopy.config import compose_config  # here: a subprocess importing these helpers need not load Hydra

    return compose_config(overrides)


# ---------------------------------------------------------------- trajectories and the data module

BUDGET = Budget(
    max_turns=4, max_response_tokens=64, max_prompt_tokens=128, max_observation_tokens=32, max_context_tokens=512
)


def trajectory(task, i, success=None, quarantine=None, length=5, version=0):
    t = Trajectory(task, i, list(range(length)), [0, 0] + [1] * (length - 2), [0.0] * length, 2)
    t.token_versions = [-1, -1] + [version] * (length - 2)
    if quarantine:
        t.quarantine, t.ending = quarantine, "quarantined"
    else:
        t.verdict, t.ending = Verdict(int(success), 1), "done"
    return t


def datamodule(tokenizer, engine, **kwargs):
    args = dict(
        split="train",
        tasks_per_step=3,
        group_size=4,
        budget=BUDGET,
        sampling=UNFILTERED,
        seed=0,
    )
    return datamodule_over(EmbeddedEnvironment(), engine, tokenizer, **{**args, **kwargs})


def group_advantages(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Eq. 3 for one group: `step_advantages` of a single group whose invalid entries are its quarantined ones."""
    return step_advantages(rewards[None], ~valid[None])[0]


# ---------------------------------------------------------------- an environment from outside the tree

# An environment package outside Canopy's tree, as docs/environments.md writes one (`mypkg/letters.py`):
# tests/test_own_environment.py installs it as a package of its own, tests/test_env_protocol.py checks it against the
# protocols.
LETTERS_ENV = '''
"""Letters: write any text containing the task's letter (a float verifier)."""
from canopy.envs.base import StepResult, Task, Verdict

LETTERS = "etaoinsh"


class LettersEpisode:
    def __init__(self, task):
        self.task, self.reply = task, ""

    def messages(self):
        return [{"role": "user", "content": f"Write any text that contains the letter {self.task.spec['letter']}."}]

    def step(self, action_text):
        self.reply = action_text
        return StepResult("thanks", done=True)

    def verdict(self):
        return Verdict.from_score(float(self.task.spec["letter"] in self.reply))

    def close(self):
        pass


class LettersEnvironment:
    name = "letters"
    max_concurrent_episodes = None  # in-process

    def tasks(self, split):
        return [Task(f"{split}-{c}", 1 + i % 2, "letters", {"letter": c}) for i, c in enumerate(LETTERS)]

    def start(self, task, seed):
        return LettersEpisode(task)

    def close(self):
        pass


ENVIRONMENT = LettersEnvironment
'''


# ---------------------------------------------------------------- train.py runs


def train(tmp_path, tiny, steps: int, *overrides: str, name: str = "run", returncode: int = 0):
    """`python train.py` on a small embedded run in `tmp_path/<name>` from the tiny model at `tiny` (the `warm_tiny`
    fixture); returns (run dir, completed process), which exited with `returncode`."""
    run_dir = tmp_path / name
    command = [sys.executable, "train.py", *train_args(tiny, run_dir, steps, *overrides)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == returncode, run.stderr[-3000:]
    return run_dir, run


def train_args(tiny, run_dir, steps: int, *overrides: str) -> list[str]:
    """train.py's arguments for a small embedded run in `run_dir` from the tiny model at `tiny`."""
    return [
        f"hydra.run.dir={run_dir}",
        f"model.tiny.dir={tiny}",
        "model.tiny.format_warmup_steps=30",
        f"trainer.max_steps={steps}",
        "data.tasks_per_step=4",
        "algorithm.group_size=4",
        "report.eval_samples_per_task=1",
        *overrides,
    ]


# ---------------------------------------------------------------- what a module imports


IMPORTS_OF = """
import runpy, sys
module, out = sys.argv.pop(1), sys.argv.pop(1)
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    with open(out, "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
"""
HEAVY = {"torch", "lightning", "transformers", "hydra", "numpy"}


def imports_of(module: str, *args, tmp_path: Path, **run) -> tuple[set[str], subprocess.CompletedProcess]:
    """Run `python -m <module> <args>` (as the trajectory log and the viewer callback do): the top-level packages it
    imported, and how it ran."""
    out = tmp_path / f"{module}.modules"
    command = [sys.executable, "-c", IMPORTS_OF, module, str(out), *map(str, args)]
    ran = subprocess.run(command, capture_output=True, timeout=120, cwd=ROOT, **run)
    return {name.split(".")[0] for name in out.read_text().split()}, ran


# ---------------------------------------------------------------- the rollout viewer in a headless Chromium

BROWSERS = ("chromium-headless-shell", "chromium", "google-chrome")


def browser() -> str:
    found = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    assert found, "no headless Chromium: `make system` installs chromium-headless-shell"  # a test that must run
    return found


def dom(page: Path, address: str = "", tmp_path: Path | None = None) -> str:
    """The page's DOM after its scripts ran, as Chromium renders `file://<page>#<address>`."""
    run = subprocess.run(
        [browser(), "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--virtual-time-budget=3000", f"--user-data-dir={tmp_path or page.parent}/chromium-profile", "--dump-dom",
         f"{page.resolve().as_uri()}#{address}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0 and "<body" in run.stdout, run.stderr[-2000:]
    return run.stdout


def element(page_dom: str, element_id: str) -> str:
    """The text inside the element with this id (up to the next section of the page)."""
    start = page_dom.index(f'id="{element_id}"')
    return page_dom[start : start + 20000]


# ---------------------------------------------------------------- AppWorld (`make appworld`)

APPWORLD_PYTHON = ROOT / ".venv-appworld" / "bin" / "python"
APPWORLD_SYNTHETIC_DATA = ROOT / "scripts" / "appworld_synthetic_data.py"  # synthetic tasks in AppWorld's format
APPWORLD_SETTINGS = PoolSettings(
    workers=2, memory_mb=4096, request_timeout_s=120, health_timeout_s=10, start_timeout_s=120
)


def code(text):
    """An agent reply whose action is the Python `text`."""
    return f"Next step.\n```python\n{text}\n```"


# ---------------------------------------------------------------- engines over fake servers (tests/fake_*.py)

STOPS = [2, 0]  # <|im_end|>, <|endoftext|> in the tiny tokenizer


def sglang_engine_for(tiny_path, tmp_path, servers, **overrides):
    from canopy.rollout.sglang import SGLangEngine, SGLangSettings

    settings = dict(urls=[s.url for s in servers], sync_dir=str(tmp_path / "sync"), max_retries=2, concurrency=8)
    engine_keys = ("shard_bytes", "bucket_bytes", "init_group", "broadcast")
    engine_kwargs = {k: overrides.pop(k) for k in engine_keys if k in overrides}
    settings = SGLangSettings(**{**settings, **overrides})
    return SGLangEngine(tiny_path, STOPS, settings, retry_backoff_s=0.0, **engine_kwargs)


def vllm_engine_for(tiny_path, tmp_path, servers, transport=None, **overrides):
    from canopy.rollout.vllm import VLLMEngine, VLLMSettings

    settings = dict(urls=[s.url for s in servers], sync_dir=str(tmp_path / "sync"), max_retries=2, concurrency=8)
    settings = VLLMSettings(**{**settings, **overrides})
    return VLLMEngine(tiny_path, STOPS, settings, retry_backoff_s=0.0, health_interval_s=0.02, transport=transport)


def tiny_weights(tiny_path, shift=0.0):
    return {name: tensor + shift for name, tensor in load_file(Path(tiny_path) / "model.safetensors").items()}


# ---------------------------------------------------------------- an environment of fixed-length episodes


class CountdownEpisode:
    """Lasts `turns` turns whatever the agent says; each step takes `step_s`."""

    def __init__(self, task: Task, step_s: float):
        self.task, self.left, self.step_s = task, task.spec["turns"], step_s

    def messages(self):
        return [{"role": "user", "content": f"episode {self.task.task_id}"}]

    def step(self, action_text):
        time.sleep(self.step_s)
        self.left -= 1
        return StepResult("ok", done=self.left == 0)

    def verdict(self):
        return Verdict(1, 1)

    def close(self):
        pass


class CountdownEnvironment:
    name = "countdown"
    max_concurrent_episodes = 64  # as a pool of workers: episodes run their steps in threads

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s

    def start(self, task, seed):
        return CountdownEpisode(task, self.step_s)

    def close(self):
        pass


# The run's typed settings as conf/train.yaml composes them, with a test's few values replaced: components take
# their settings whole, and a test names only what it changes.


@functools.cache
def _composed():
    return config()


def section(node: str, **values):
    """The settings object of config node `node` (`algorithm`, `data`, ...), with `values` replaced."""
    return dataclasses.replace(OmegaConf.to_object(_composed()[node]), **values)


def deal(values: dict, nodes: tuple[str, ...]) -> dict[str, dict]:
    """`values` dealt to the sections of `nodes` whose schema has each key; a key none has is an error."""
    dealt = {node: {} for node in nodes}
    for key, value in values.items():
        node = next((n for n in nodes if key in _composed()[n]), None)  # a schema-typed node: its schema's keys
        if node is None:
            raise TypeError(f"{key} is a key of none of {nodes}")
        dealt[node][key] = value
    return dealt


def canopy_module(model_path, *, parallel: ParallelSettings | None = None, seed: int = 0, engine=None, **values):
    """A `CanopyModule` with train.yaml's algorithm, optim, trainer and sampling settings but for `values`."""
    from canopy.modules.canopy_module import CanopyModule

    dealt = deal(values, ("algorithm", "optim", "trainer", "sampling"))
    return CanopyModule(
        str(model_path),
        **{node: section(node, **changed) for node, changed in dealt.items()},
        parallel=parallel or ParallelSettings(),
        seed=seed,
        engine=engine,
    )


def budget_settings(budget: Budget) -> BudgetSettings:
    return BudgetSettings(name="test", rope_scaling=None, **dataclasses.asdict(budget))


def datamodule_over(env, engine, tokenizer, *, budget: Budget, seed: int = 0, trajectory_log=None, kind=None, **values):
    """A `RolloutDataModule` with train.yaml's data and algorithm settings but for `values` (and `sampling`,
    `max_quarantine_fraction`, `rollout_timeout_s`: train.yaml's unless given), over `budget`; `kind` is a subclass
    to build instead."""
    from canopy.datamodules.rollout import RolloutDataModule

    extra = {key: values.pop(key) for key in ("max_quarantine_fraction", "rollout_timeout_s") if key in values}
    sampling = values.pop("sampling", None)
    dealt = deal(values, ("data", "algorithm"))
    cfg = _composed()
    return (kind or RolloutDataModule)(
        env,
        engine,
        tokenizer,
        **{node: section(node, **changed) for node, changed in dealt.items()},
        sampling=sampling or section("sampling"),
        budget=budget_settings(budget),
        max_quarantine_fraction=extra.get("max_quarantine_fraction", cfg.env.max_quarantine_fraction),
        rollout_timeout_s=extra.get("rollout_timeout_s", cfg.trainer.rollout_timeout_s),
        seed=seed,
        trajectory_log=trajectory_log,
    )


def logged_episodes(**values):
    """`trajectories.*` as conf/train.yaml composes it (every episode of every step), with `values` replaced."""
    from canopy.trajectories import sampling_of

    return dataclasses.replace(sampling_of(section("trajectories")), **values)
