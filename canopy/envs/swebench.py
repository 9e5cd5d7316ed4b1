"""SWE-bench (Section 4.4, Appendix H, Table A3): mini-swe-agent v1's bash-only harness in a sandbox of the task's
image, graded by swebench 5.x in a fresh sandbox of the same image.

Harness (mini-swe-agent 1.17.5, read from the installed package at run time, never copied): its
`config/extra/swebench.yaml` templates (system, instance, observation, format error) and `AgentConfig`'s
`timeout_template` and `action_regex`, rendered with jinja2 as its `DefaultAgent` does. A reply must hold exactly
one ```bash block, else the format-error template comes back (not an ending; an invalid action, `StepResult.valid`);
each command runs in a fresh `bash -lc` in /testbed with its `timeout` (60 s), and a command past it comes back as
the timeout template (not an ending). The episode is submitted when a command's first output line is
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` and it exits 0; the rest of its output is the patch. Observations past
10,000 characters are cut by the template itself (first and last 5,000); the budget's tool-response cap then applies
in tokens.

Rewards (Table A3), as `Verdict.outcome`:
  resolved 1 | unresolved 0 (tests fail, error or hang) |
  no_submission, rollout_timeout, empty_patch, patch_apply_failed -> `no_patch_reward` (-0.2)
  image_unavailable 0 (on the splits of `missing_image_scores_zero`: Appendix H scores Verified instances whose
  image cannot be obtained 0; on other splits a missing image is a serving fault)
Command timeouts, OOM-killed commands, fork bombs and network attempts are observations. Serving faults are
quarantined (`EnvironmentFault`): image_missing (training), wrong_base_commit, sandbox_failed,
grading_sandbox_failed, grading_infra_failure (swebench's environment-tier log signatures).
"""

import ast
import functools
import importlib.util
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from canopy.envs.attribution import scratch_fault
from canopy.envs.base import EnvironmentFault, StepResult, Task, Verdict
from canopy.envs.isolation import ImageMissing, RuntimeSettings, SandboxError, build_runtime
from canopy.envs.swe_grading import grade
from canopy.envs.swe_guard import POLICIES
from canopy.errors import ConfigError, require

MINI_SWE_AGENT_VERSION = "1.17.5"
SUBMIT_MARKERS = ("MINI_SWE_AGENT_FINAL_OUTPUT", "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")  # DefaultAgent.has_finished
DIFFICULTY_TIERS = {"<15 min fix": 1, "15 min - 1 hour": 2, "1-4 hours": 3, ">4 hours": 4}  # Verified's labels
NO_PATCH_OUTCOMES = ("no_submission", "rollout_timeout", "empty_patch", "patch_apply_failed")


class Harness:
    """mini-swe-agent v1's bash-only harness: its templates, action regex and environment settings."""

    def __init__(self, config: str = "extra/swebench.yaml"):
        import jinja2
        import yaml

        spec = importlib.util.find_spec("minisweagent")
        if spec is None:
            raise ImportError(
                f"mini-swe-agent is not installed: pip install --no-deps mini-swe-agent=={MINI_SWE_AGENT_VERSION}"
            )
        package = Path(spec.submodule_search_locations[0])
        defaults = _dataclass_defaults(package / "agents" / "default.py", "AgentConfig")
        loaded = yaml.safe_load((package / "config" / config).read_text())
        self.agent = {**defaults, **loaded["agent"]}
        self.environment = loaded["environment"]
        self.action_regex = re.compile(self.agent["action_regex"], re.DOTALL)
        self.command_timeout = float(self.environment["timeout"])
        self.env_vars = {key: str(value) for key, value in self.environment.get("env", {}).items()}
        self._jinja = jinja2.Environment(undefined=jinja2.StrictUndefined)

    def render(self, name: str, **variables) -> str:
        """Template `name` with the agent's and environment's settings as variables, as `DefaultAgent` renders."""
        return self._jinja.from_string(self.agent[name]).render(**variables, **self.agent, **self.environment)

    def messages(self, problem_statement: str) -> list[dict]:
        return [
            {"role": "system", "content": self.render("system_template")},
            {"role": "user", "content": self.render("instance_template", task=problem_statement)},
        ]

    def actions(self, reply: str) -> list[str]:
        return [action.strip() for action in self.action_regex.findall(reply)]


def _dataclass_defaults(path: Path, name: str) -> dict:
    """The literal field defaults of dataclass `name` in a source file, read without importing the package (which
    pulls litellm)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                item.target.id: ast.literal_eval(item.value)
                for item in node.body
                if isinstance(item, ast.AnnAssign) and item.value is not None
            }
    raise ImportError(f"{name} is no longer defined in {path}: mini-swe-agent changed shape")


@functools.cache
def harness() -> Harness:
    return Harness()


def load_instances(path: str | Path) -> list[dict]:
    """SWE-bench instances in swebench 5.x's format (JSONL), FAIL_TO_PASS / PASS_TO_PASS as lists."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"SWE-bench instances {path} do not exist: prepare them with python -m canopy.tools.swe_data "
            "(docs/environments.md)"
        )
    instances = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            if isinstance(row.get(key), str):
                row[key] = json.loads(row[key])
        missing = [k for k in ("instance_id", "image", "eval_script", "log_parser", "FAIL_TO_PASS") if k not in row]
        if missing:
            raise ValueError(
                f"{path}:{number}: instance lacks {missing}: convert it with python -m canopy.tools.swe_data convert"
            )
        instances.append(row)
    return instances


def instance_task(instance: dict) -> Task:
    return Task(
        task_id=instance["instance_id"],
        tier=DIFFICULTY_TIERS.get(instance.get("difficulty"), 1),
        scenario=instance["repo"],
        spec=instance,
    )


@dataclass(frozen=True)
class SWEBenchSettings:
    """`env.swebench.*` (conf/env/swebench.yaml): the schema and the only defaults of those keys, Table A3's values."""

    data: dict[str, str] = field(default_factory=dict)  # split -> instances JSONL in swebench 5.x's format
    # (swe_data convert / filter)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)  # each episode's sandbox (Table A3: 2 CPU, 6 GB)
    no_patch_reward: float = -0.2  # Table A3: no submission, empty patch, patch does not apply, rollout timeout
    rollout_timeout_s: float = 5400.0
    eval_timeout_s: float = 1800.0  # the eval script; past it the tests count as failed (0)
    command_timeout_s: float | None = None  # null: mini-swe-agent's own (60 s); a command past it is an observation
    missing_image_scores_zero: list[str] = field(default_factory=list)  # splits where a missing image scores 0
    # (Appendix H: Verified); else quarantined
    check_base_commit: bool = True  # HEAD must be base_commit when an episode starts (else quarantined)
    tamper: str = "restore"  # restore | reject | off: what the patch changed of how its tests run (conftest.py,
    # runner configuration, plugins, start-up hooks: canopy/envs/swe_guard.py) is put back before grading, or scores
    # unresolved untested; off grades as upstream does

    def __post_init__(self):
        if isinstance(self.runtime, dict):  # as a pool's worker receives it
            object.__setattr__(self, "runtime", RuntimeSettings(**self.runtime))

    def validate(self, pool) -> None:

        self.runtime.validate()
        require(
            self.data, "env.swebench.data is empty: map each split to an instances JSONL (env.swebench.data.train=...)"
        )
        for split, path in self.data.items():
            require(
                Path(path).is_file(),
                f"env.swebench.data.{split}={path} does not exist: prepare it with python -m canopy.tools.swe_data "
                f"(convert and filter; generate for the toy tasks), or drop the split (~env.swebench.data.{split})",
            )
        unknown = sorted(set(self.missing_image_scores_zero) - set(self.data))
        require(
            not unknown, f"env.swebench.missing_image_scores_zero names splits {unknown} that env.swebench.data lacks"
        )
        require(
            self.tamper in POLICIES,
            f"env.swebench.tamper={self.tamper!r} is unknown: use restore (the default), reject or off (upstream)",
        )
        require(self.no_patch_reward <= 0, f"env.swebench.no_patch_reward={self.no_patch_reward} must be <= 0")
        for key in ("rollout_timeout_s", "eval_timeout_s"):
            require(getattr(self, key) > 0, f"env.swebench.{key}={getattr(self, key)} must be > 0")
        command = self.command_timeout_s or harness().command_timeout
        for op, needed in (("step", command), ("verdict", self.eval_timeout_s)):
            timeout = pool.timeout(op)
            require(
                timeout > needed + 30,
                f"env.pool.operation_timeouts_s.{op}={timeout} must exceed {needed:.0f} s (the SWE-bench "
                f"{'command' if op == 'step' else 'grading'} timeout) by > 30 s, or a slow command would be blamed on "
                "the worker",
            )


class SWEBenchEpisode:
    def __init__(self, env: "SWEBenchEnvironment", task: Task):
        self.env, self.task, self.instance = env, task, task.spec
        self.harness, self.started = harness(), time.monotonic()
        self.sandbox, self.submission, self.ending = None, None, "no_submission"
        self.image_unavailable = False
        try:
            self.sandbox = env.runtime.start(self.instance["image"])
        except ImageMissing as error:
            if task.spec["split"] not in env.settings.missing_image_scores_zero:
                raise EnvironmentFault("image_missing", str(error)) from None
            self.image_unavailable = True
            return
        except SandboxError as error:
            raise EnvironmentFault("sandbox_failed", str(error)) from None
        if env.settings.check_base_commit:
            try:
                head = self._run("git rev-parse HEAD", 60).output.strip()
                if head != self.instance["base_commit"]:
                    raise EnvironmentFault(
                        "wrong_base_commit", f"HEAD {head[:40]!r}, expected {self.instance['base_commit']}"
                    )
            except EnvironmentFault:
                self.close()
                raise

    def _run(self, command: str, timeout: float):
        try:
            return self.sandbox.run(command, timeout, env=self.harness.env_vars)
        except SandboxError as error:
            raise EnvironmentFault("sandbox_failed", str(error)) from None

    def messages(self) -> list[dict]:
        return self.harness.messages(self.instance["problem_statement"])

    def step(self, action_text: str) -> StepResult:
        if self.image_unavailable:
            self.ending = "image_unavailable"
            return StepResult("The task's image is unavailable.", done=True)
        if time.monotonic() - self.started > self.env.settings.rollout_timeout_s:
            self.ending = "rollout_timeout"
            return StepResult("The rollout timed out.", done=True)
        actions = self.harness.actions(action_text)
        if len(actions) != 1:
            text = self.harness.render("format_error_template", actions=actions)
            return StepResult(text, done=False, valid=False)  # not exactly one bash block: an invalid action
        result = self._run(actions[0], self.env.command_timeout)
        self._check_scratch()
        if result.timed_out:
            text = self.harness.render("timeout_template", action={"action": actions[0]}, output=result.output)
            return StepResult(text, done=False)
        lines = result.output.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() in SUBMIT_MARKERS and result.returncode == 0:
            self.submission = "".join(lines[1:])
            return StepResult("Submitted.", done=True)
        output = {"output": result.output, "returncode": result.returncode}
        return StepResult(self.harness.render("action_observation_template", output=output), done=False)

    def _check_scratch(self) -> None:
        """A scratch filesystem filled by another tenant fails the policy's writes: the serving layer's fault
        (`canopy.envs.attribution.full_scratch`; bwrap's sandboxes only: a container's layer is the daemon's)."""
        runtime = self.env.runtime
        fault = scratch_fault(runtime.scratch, runtime.writable_folders) if runtime.measures_writes else None
        if fault is not None:
            raise fault

    def verdict(self) -> Verdict:
        """Graded in a fresh sandbox, once this episode's own is gone (nothing it left running meets the grading)."""
        self.close()
        self._check_scratch()
        total = len(self.instance["FAIL_TO_PASS"]) + len(self.instance["PASS_TO_PASS"])
        no_patch = self.env.settings.no_patch_reward
        if self.image_unavailable:
            return Verdict(0, total, "image_unavailable")
        if self.submission is None:
            return Verdict(0, total, self.ending, fixed_reward=no_patch)
        settings = self.env.settings
        result = grade(
            self.env.runtime, self.instance, self.submission, settings.eval_timeout_s, tamper=settings.tamper
        )
        if result.outcome in NO_PATCH_OUTCOMES:
            return Verdict(0, result.total, result.outcome, fixed_reward=no_patch)
        return Verdict(result.passed, result.total, result.outcome, tamper=result.tamper, tampered=result.tampered)

    def close(self) -> None:
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            sandbox.close()


class SWEBenchEnvironment:
    name = "swebench"
    max_concurrent_episodes: int | None = None  # in-process; a pool of them declares its workers

    def __init__(self, **settings):
        self.settings = SWEBenchSettings(**settings)
        self.runtime = build_runtime(self.settings.runtime)
        self.command_timeout = self.settings.command_timeout_s or harness().command_timeout

    def tasks(self, split: str) -> list[Task]:
        if split not in self.settings.data:
            raise ValueError(f"env.swebench.data has no split {split!r}: it has {sorted(self.settings.data)}")
        return [instance_task({**instance, "split": split}) for instance in load_instances(self.settings.data[split])]

    def start(self, task: Task, seed: int) -> SWEBenchEpisode:
        return SWEBenchEpisode(self, task)

    def close(self) -> None:
        """Nothing is held between episodes (each episode closes its own sandbox)."""


ENVIRONMENT, SETTINGS = SWEBenchEnvironment, SWEBenchSettings


def environment_kwargs(env) -> dict:
    """`env.swebench.*`, checked against the pool (per-operation timeouts) and the machine (the runtime must run
    here: one line naming the fix otherwise)."""
    from omegaconf import OmegaConf

    from canopy.envs.isolation import RuntimeUnavailable, check_runtime
    from canopy.envs.pool import PoolSettings

    if "swebench" not in env:
        raise ConfigError("env.swebench is missing: select SWE-bench with env=swebench (a config group), not env.name")
    settings = SWEBenchSettings(**OmegaConf.to_container(env.swebench, resolve=True))
    pool = PoolSettings(**env.pool)
    if pool.workers == 0:
        raise ConfigError("env.name=swebench runs behind the pool: set env.pool.workers >= 1")
    settings.validate(pool)
    try:
        check_runtime(settings.runtime)
    except RuntimeUnavailable as error:
        raise ConfigError(f"env.swebench.runtime: {error}") from None
    return asdict(settings)
