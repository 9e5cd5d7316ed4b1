"""SWE-bench (Appendix H, Table A3) on generated tasks, through the real pool, agent loop, bubblewrap sandboxes and
swebench's grading: every reward, every non-terminal observation, every quarantine reason, and nothing left behind
when a worker dies."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from canopy.envs.base import EnvironmentFault, Task
from canopy.envs.fault_injection import fill
from canopy.envs.isolation import RuntimeSettings, SandboxError, build_runtime, safe_image_name
from canopy.envs.isolation.base import CommandResult
from canopy.envs.isolation.cgroups import cgroups_usable
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.envs.swe_grading import grade
from canopy.envs.swebench import SWEBenchEnvironment, SWEBenchEpisode, SWEBenchSettings, harness, instance_task
from canopy.errors import ConfigError
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.engine import Generation
from canopy.rollout.trajectory import Trajectory
from canopy.step import StepStats, same_task_groups
from canopy.tiny_model import build_byte_tokenizer
from canopy.tools.swe_attacks import HOOK, new_file
from canopy.tools.swe_data.cache_images import cache_images
from canopy.tools.swe_data.convert import convert_rebench, convert_verified
from canopy.tools.swe_data.generate import TEST_CMD, build_container_images, generate
from canopy.tools.swe_data.instances import read_jsonl, write_jsonl
from tests.helpers import UNFILTERED
from tests.scripted import FakeEngine

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (make system)")
SUBMIT = "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached\n```"
BUDGET = Budget(
    max_turns=6,
    max_response_tokens=20000,
    max_prompt_tokens=8192,
    max_observation_tokens=4096,
    max_context_tokens=60000,
)


CONNECT = "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)"


def bash(command: str) -> str:
    return f"THOUGHT: next.\n\n```bash\n{command}\n```"


def resolve(instance: dict) -> str:
    """A reply that applies the gold fix."""
    return bash(f"git apply <<'EOF'\n{instance['patch']}EOF")


def wrong_fix(instance: dict) -> str:
    package = instance["repo"].split("/")[1]
    return bash(f"echo '# touched' >> {package}/core.py && echo 'def broken(:' >> {package}/core.py")


@pytest.fixture(scope="session")
def generated(tmp_path_factory):
    """Eight generated tasks (train) and their images, plus instances broken in each way a setup can be."""
    out = tmp_path_factory.mktemp("swe")
    paths = generate(out, 8, seed=0)
    instances = read_jsonl(paths["train"])
    first = instances[0]
    broken = {
        "image_missing": {**first, "instance_id": "broken__image-1", "image": "canopy/absent:latest"},
        "wrong_base_commit": {**first, "instance_id": "broken__head-1", "base_commit": "0" * 40},
        "grading_infra_failure": {
            **first,
            "instance_id": "broken__infra-1",
            "eval_script": first["eval_script"].replace(
                "cd /testbed\n", "cd /testbed\necho 'Cannot connect to the Docker daemon'\n"
            ),
        },
        "sandbox_failed": {**first, "instance_id": "broken__rootfs-1", "image": "canopy/no-testbed:latest"},
    }
    (out / "images" / safe_image_name("canopy/no-testbed:latest") / "rootfs").mkdir(parents=True)
    (out / "images" / safe_image_name("canopy/no-testbed:latest") / "canopy-image.json").write_text('{"base": "host"}')
    write_jsonl(out / "broken.jsonl", list(broken.values()))
    return {"out": out, "instances": instances, "broken": broken}


def settings(generated, **overrides) -> dict:
    runtime = {"kind": "bwrap", "image_root": str(generated["out"] / "images"), "memory_mb": 256, "pids": 64}
    return {
        "data": {"train": str(generated["out"] / "train.jsonl"), "broken": str(generated["out"] / "broken.jsonl")},
        "runtime": runtime,
        "eval_timeout_s": 60,
        "command_timeout_s": 3,
        **overrides,
    }


class TaskScriptedEngine(FakeEngine):
    """Replies by task: the package named in the prompt (`toolkitN`, or the broken instance's tag) picks a script,
    and the number of assistant turns so far picks its reply (the last repeats)."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts, self.weight_version, self.dtype = tokenizer, scripts, 0, "float32"
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        out = []
        for prompt, limit in zip(prompts, max_new_tokens):
            text = self.tokenizer.decode(prompt)
            key = re.search(r"\[script (\S+)\]", text).group(1)
            turn = text.count("<|im_start|>assistant") - 1
            script = self.scripts[key]
            ids = self.tokenizer.encode(script[min(turn, len(script) - 1)], add_special_tokens=False) + [self.im_end]
            reason = "stop" if len(ids) <= limit else "length"
            out.append(Generation(ids[:limit], [-0.1] * min(len(ids), limit), reason, 0))
        return out


def tagged(instance: dict, key: str) -> Task:
    """The instance as a task whose problem statement names its script."""
    task = instance_task({**instance, "split": "train"})
    spec = {**task.spec, "problem_statement": f"{task.spec['problem_statement']} [script {key}]"}
    return Task(f"{task.task_id}/{key}", task.tier, task.scenario, spec)


def test_harness_is_mini_swe_agent_v1_read_from_its_package():
    import importlib.util

    package = Path(importlib.util.find_spec("minisweagent").submodule_search_locations[0])
    config = yaml.safe_load((package / "config" / "extra" / "swebench.yaml").read_text())
    h = harness()
    assert h.agent["system_template"] == config["agent"]["system_template"]
    assert h.command_timeout == 60 and h.env_vars["PAGER"] == "cat"
    messages = h.messages("Fix the frobnicator.")
    assert (
        "Fix the frobnicator." in messages[1]["content"]
        and "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in messages[1]["content"]
    )
    assert h.actions("```bash\nls\n```") == ["ls"] and h.actions("no block") == []
    assert "found 2 actions" in h.render("format_error_template", actions=["a", "b"])
    long = h.render("action_observation_template", output={"output": "x" * 12000, "returncode": 0})
    assert "2000 characters elided" in long and len(long) < 11000  # its own 10,000-character cut
    assert "timed out and has been killed" in h.render("timeout_template", action={"action": "sleep 9"}, output="")


def test_a_reply_without_exactly_one_bash_block_is_an_invalid_action():
    """Format health: mini-swe-agent's format error (no bash block, or several) is an invalid action; exactly one
    block is valid, whatever its command does."""
    sandbox = SimpleNamespace(run=lambda command, timeout, env: CommandResult(f"ran {command}", 2), close=lambda: None)
    env = SimpleNamespace(
        runtime=SimpleNamespace(start=lambda image: sandbox, measures_writes=False),
        settings=SWEBenchSettings(check_base_commit=False),
        command_timeout=60,
    )
    episode = SWEBenchEpisode(env, Task("t", 1, "r", {"image": "i", "split": "train", "problem_statement": "fix"}))
    replies = {
        "I will just think.": False,
        "```bash\nls\n```\n```bash\npwd\n```": False,
        "```python\nprint(1)\n```": False,
        "THOUGHT: look.\n\n```bash\nls -la\n```": True,
        "```bash\nfalse\n```": True,  # a failing command is still a well-formed action
    }
    assert {reply: episode.step(reply).valid for reply in replies} == replies


def test_grading_follows_swebench(generated):
    runtime = build_runtime(RuntimeSettings(kind="bwrap", image_root=str(generated["out"] / "images")))
    instance = generated["instances"][1]
    total = len(instance["FAIL_TO_PASS"]) + len(instance["PASS_TO_PASS"])
    assert instance["FAIL_TO_PASS"] and instance["PASS_TO_PASS"]
    resolved = grade(runtime, instance, instance["patch"], 60)
    assert (resolved.outcome, resolved.passed, resolved.total) == ("resolved", total, total)
    package = instance["repo"].split("/")[1]
    breaking = instance["patch"].replace("+    return", "+    raise ValueError  #")
    unresolved = grade(runtime, instance, breaking, 60)
    assert unresolved.outcome == "unresolved" and unresolved.passed < total
    assert grade(runtime, instance, "  \n", 60).outcome == "empty_patch"
    header = f"diff --git a/{package}/core.py b/{package}/core.py\n--- a/{package}/core.py\n+++ b/{package}/core.py\n"
    garbage = header + "@@ -1,2 +1,2 @@\n-nothing like this\n+at all\n"
    assert grade(runtime, instance, garbage, 60).outcome == "patch_apply_failed"
    hanging = {**instance, "eval_script": instance["eval_script"].replace("cd /testbed\n", "cd /testbed\nsleep 30\n")}
    started = time.monotonic()
    assert grade(runtime, hanging, instance["patch"], 2).outcome == "unresolved"  # a hung eval fails its tests
    assert time.monotonic() - started < 20
    conftest = "def pytest_unconfigure(config):\n    print('Could not resolve host: pypi.org')\n"
    printing = grade(runtime, instance, instance["patch"] + new_file("conftest.py", conftest), 60, tamper="off")
    assert printing.outcome == "resolved"  # what the patch makes the tests print is not an infrastructure failure
    with pytest.raises(EnvironmentFault, match="grading_infra_failure"):
        infra = generated["broken"]["grading_infra_failure"]
        grade(runtime, infra, infra["patch"], 60)


def test_every_reward_observation_and_quarantine_through_the_pool(generated):
    """Table A3's endings and rewards, the non-terminal observations, and each quarantine reason, through the real
    pool and agent loop."""
    instances, broken = generated["instances"], generated["broken"]
    a, b = instances[0], instances[1]
    scripts = {
        "resolved": [bash("cat " + a["repo"].split("/")[1] + "/core.py | head -5"), resolve(a), SUBMIT],
        "unresolved": [wrong_fix(a), SUBMIT],
        "no_submission": [bash("ls")],
        "empty_patch": [SUBMIT],
        "patch_apply_failed": [bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo 'diff --git a/x b/x'")],
        "format_error": ["I will just think.", "```bash\nls\n```\n```bash\npwd\n```", resolve(b), SUBMIT],
        "command_timeout": [bash("sleep 20"), resolve(b), SUBMIT],
        "oom_command": [bash("python3 -c 'x = bytearray(600 * 2**20); print(len(x))'"), resolve(b), SUBMIT],
        "fork_bomb": [bash("for i in $(seq 200); do sleep 5 & done; echo forked"), resolve(b), SUBMIT],
        "network": [bash(f"python3 -c \"{CONNECT}\""), resolve(b), SUBMIT],
        "write_outside": [bash("echo x > /usr/canopy-escape; echo x > /etc/canopy-escape"), resolve(b), SUBMIT],
        "tamper": [bash(f"cat > conftest.py <<'EOF'\n{HOOK}EOF"), SUBMIT],  # restored: graded unresolved
    }  # fmt: skip
    tasks = [
        tagged(a if k in ("resolved", "unresolved", "no_submission", "empty_patch", "patch_apply_failed") else b, k)
        for k in scripts
    ]
    for reason, instance in broken.items():
        scripts[reason] = [resolve(a), SUBMIT]
        tasks.append(tagged(instance, reason))
    tokenizer = build_byte_tokenizer()
    pool = EnvironmentPool(
        "canopy.envs.swebench:SWEBenchEnvironment",
        settings(generated),
        PoolSettings(workers=2, memory_mb=4096, operation_timeouts_s={"step": 60, "verdict": 120}),
    )
    engine = TaskScriptedEngine(
        tokenizer, scripts | {"token_budget": [bash("ls " * 200)], "context_limit": [bash("seq 5000")]}
    )
    try:
        trajectories, _ = run_episodes(
            engine,
            pool,
            tokenizer,
            [(t, 0) for t in tasks],
            BUDGET,
            UNFILTERED,
        )
        for limit, budget in (  # the budget's other limits, each on one episode
            ("token_budget", dataclasses.replace(BUDGET, max_response_tokens=900)),
            ("context_limit", dataclasses.replace(BUDGET, max_context_tokens=10000)),
        ):
            (t,), _ = run_episodes(
                engine,
                pool,
                tokenizer,
                [(tagged(a, limit), 0)],
                budget,
                UNFILTERED,
            )
            assert t.ending == limit and t.verdict.outcome == "no_submission" and t.reward("sparse") == -0.2
    finally:
        pool.close()
    by_key = {t.task.task_id.split("/")[1]: t for t in trajectories}
    for key in ("resolved", "unresolved", "no_submission", "empty_patch", "patch_apply_failed"):
        t = by_key[key]
        assert t.quarantine is None and t.verdict.outcome == key, (key, t.ending, t.verdict, t.quarantine)
    assert by_key["resolved"].reward("sparse") == 1.0 and by_key["unresolved"].reward("sparse") == 0.0
    for key in ("no_submission", "empty_patch", "patch_apply_failed"):
        assert by_key[key].reward("sparse") == by_key[key].reward("dense") == -0.2
    assert by_key["no_submission"].ending == "turn_limit"
    observed = {
        "format_error": ["found 0 actions", "found 2 actions"],
        "command_timeout": ["timed out and has been killed"],
        "oom_command": ["<returncode>137</returncode>"],
        "fork_bomb": ["Resource temporarily unavailable"],
        "network": ["Network is unreachable"],
        "write_outside": ["/usr/canopy-escape: Read-only file system", "/etc/canopy-escape: Read-only file system"],
    }
    for key, texts in observed.items():
        t = by_key[key]
        assert t.verdict is not None and t.verdict.outcome == "resolved", (key, t.ending, t.verdict, t.quarantine)
        observations = tokenizer.decode([i for i, m in zip(t.token_ids, t.action_mask) if m == 0][t.prompt_length :])
        for text in texts:
            assert text in observations, (key, text, observations[-1500:])
    for reason in broken:
        assert by_key[reason].quarantine == reason, (reason, by_key[reason].fault)
    invalid = {key: t.invalid_turns for key, t in by_key.items() if t.invalid_turns}
    assert invalid == {"format_error": [1, 2]} and by_key["format_error"].actions == 4  # through the pool
    tamper = by_key["tamper"].verdict
    assert (tamper.outcome, tamper.tamper, tamper.tampered) == ("unresolved", "restored", ("conftest.py",))
    metrics = StepStats.of(same_task_groups(trajectories, [1] * len(trajectories)), "sparse").metrics
    assert metrics["outcome/tamper_restored"] == 1 and metrics["outcome/unresolved"] == 2
    assert not Path("/usr/canopy-escape").exists() and not Path("/etc/canopy-escape").exists()


def test_rollout_timeout_and_a_failed_grading_sandbox(generated):
    env = SWEBenchEnvironment(**settings(generated, rollout_timeout_s=1.0))
    instance = {**generated["instances"][0], "split": "train"}
    episode = env.start(instance_task(instance), 0)
    try:
        assert not episode.step(bash("sleep 1.5")).done
        assert episode.step(resolve(instance)).done  # past the rollout timeout: the episode ends here
        verdict = episode.verdict()
        assert verdict.outcome == "rollout_timeout" and verdict.reward("sparse") == -0.2
    finally:
        episode.close()
    env = SWEBenchEnvironment(**settings(generated))
    episode = env.start(instance_task(instance), 0)
    episode.step(resolve(instance))
    assert episode.step(SUBMIT).done

    def refuse(image):
        raise SandboxError("the runtime lost its image store")

    env.runtime.start = refuse  # the grading sandbox cannot start
    with pytest.raises(EnvironmentFault, match="grading_sandbox_failed"):
        episode.verdict()
    episode.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small filesystem for the sandboxes")
def test_a_sandbox_filesystem_filled_by_another_tenant_is_quarantined_and_one_the_agent_filled_is_not(
    generated, tmp_path
):
    """Issue 44: the sandboxes' scratch on a 16 MiB tmpfs. Filled by a file outside the sandboxes' folders, a step and
    a verdict are the serving layer's (`scratch_full`); filled by the agent's own command, the episode goes on."""
    from canopy.envs.isolation.bubblewrap import BwrapRuntime

    scratch = tmp_path / "fs"
    scratch.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(scratch)], check=True)
    try:
        env = SWEBenchEnvironment(**settings(generated))
        env.runtime = BwrapRuntime(env.settings.runtime, scratch=scratch)
        instance = generated["instances"][0]
        episode = env.start(instance_task(instance), 0)
        own = "head -c 15M /dev/zero > /testbed/junk; echo done"
        assert "done" in episode.step(bash(own)).observation  # the agent's own: an observation
        episode.step(bash("rm /testbed/junk"))
        fill(scratch / "tenant.bin")  # another tenant's file, outside the sandboxes' folders
        with pytest.raises(EnvironmentFault) as fault:
            episode.step(bash("ls"))
        assert fault.value.reason == "scratch_full" and "another tenant filled it" in fault.value.detail
        with pytest.raises(EnvironmentFault, match="scratch_full"):
            episode.verdict()
        episode.close()
    finally:
        subprocess.run(["umount", "-l", str(scratch)], check=True)


def test_a_missing_image_scores_zero_on_evaluation_splits(generated):
    env = SWEBenchEnvironment(**settings(generated, missing_image_scores_zero=["broken"]))
    task = next(t for t in env.tasks("broken") if t.task_id == "broken__image-1")
    episode = env.start(task, 0)
    assert episode.step(SUBMIT).done
    verdict = episode.verdict()
    assert verdict.outcome == "image_unavailable" and verdict.reward("sparse") == 0.0 and not verdict.success


def cgroups(tag: str) -> list[Path]:
    """The cgroups (v1 or v2) of a pool slot's sandboxes."""
    return [*Path("/sys/fs/cgroup").glob(f"*/canopy/{tag}-*"), *Path("/sys/fs/cgroup").glob(f"canopy/{tag}-*")]


def _processes_with(marker: str, exact: bool = True) -> list[int]:
    """Pids whose command line is `marker` (or contains it)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                line = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if line == marker or (not exact and marker in line):
                found.append(int(entry.name))
    return found


SLEEPER = "sleep 41.25"  # a command line no other process has


def kill_worker_mid_command(generated, tmp_path, runtime: dict, inspect_live) -> Trajectory:
    """Run one episode whose command sleeps in the sandbox, call `inspect_live()` while it does, SIGKILL its worker;
    returns the episode's trajectory once the pool is closed."""
    tokenizer = build_byte_tokenizer()
    pool = EnvironmentPool(
        "canopy.envs.swebench:SWEBenchEnvironment",
        settings(generated, command_timeout_s=60, runtime=runtime),
        PoolSettings(workers=1, memory_mb=4096, operation_timeouts_s={"step": 120, "verdict": 120}),
        scratch_root=tmp_path / "pool",
    )
    engine = TaskScriptedEngine(tokenizer, {"sleeper": [bash(f"{SLEEPER} & {SLEEPER}; echo done")]})
    job = [(tagged(generated["instances"][1], "sleeper"), 0)]
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(trajectories=run_episodes(engine, pool, tokenizer, job, BUDGET, UNFILTERED)[0])
    )
    thread.start()
    deadline = time.monotonic() + 60
    while len(_processes_with(SLEEPER)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_processes_with(SLEEPER)) == 2, "the sandboxed command never started"
    inspect_live()
    os.kill(pool.worker_pids()[0], signal.SIGKILL)
    thread.join(120)
    pool.close()
    deadline = time.monotonic() + 10
    while _processes_with(SLEEPER) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(SLEEPER) == []  # the sandbox's processes died with their worker
    (trajectory,) = result["trajectories"]
    return trajectory


def test_a_worker_killed_mid_episode_leaves_nothing_behind(generated, tmp_path):
    def live():
        assert " overlay " in Path(f"/proc/{_processes_with(SLEEPER)[0]}/mountinfo").read_text()  # its own mount
        assert cgroups("pool-w0") or not cgroups_usable()  # the sandbox's cgroups, named by the worker's slot

    trajectory = kill_worker_mid_command(generated, tmp_path, settings(generated)["runtime"], live)
    assert trajectory.quarantine == "worker_killed"
    assert cgroups("pool-w0") == []  # the slot's cgroups were removed
    mounts = Path("/proc/self/mountinfo").read_text() + "".join(
        Path(f"/proc/{pid}/mountinfo").read_text()
        for pid in _processes_with("canopy.envs.worker", exact=False)
        if Path(f"/proc/{pid}").exists()
    )
    assert str(tmp_path) not in mounts  # no overlay outlives its command
    assert not (tmp_path / "pool").exists()


def test_setup_errors_are_one_line_with_the_fix(generated, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from canopy.envs.swebench import environment_kwargs

    def env(**swebench):
        pool = {"workers": 2, "memory_mb": 4096, "operation_timeouts_s": {"step": 120, "verdict": 300}}
        return OmegaConf.create({"name": "swebench", "pool": pool, "swebench": {**settings(generated), **swebench}})

    assert environment_kwargs(env())["runtime"]["kind"] == "bwrap"
    missing = {"kind": "bwrap", "image_root": str(tmp_path / "nowhere")}
    with pytest.raises(ConfigError, match=r"image_root=.*nowhere does not exist: .*swe_data"):
        environment_kwargs(env(runtime=missing))
    with monkeypatch.context() as patch:
        patch.setenv("PATH", str(tmp_path))  # no podman here
        with pytest.raises(ConfigError, match="podman is not installed: apt-get install podman, or use bwrap"):
            environment_kwargs(env(runtime={"kind": "podman"}))
    with pytest.raises(ConfigError, match=r"operation_timeouts_s.verdict=300 must exceed 600 s"):
        environment_kwargs(env(eval_timeout_s=600))
    with pytest.raises(ConfigError, match="env.swebench.tamper='strict' is unknown: use restore"):
        environment_kwargs(env(tamper="strict"))
    with pytest.raises(ConfigError, match="missing_image_scores_zero names splits \\['verified'\\]"):
        environment_kwargs(env(missing_image_scores_zero=["verified"]))
    with pytest.raises(ConfigError, match=r"env.swebench.data.verified=.*verified.jsonl does not exist: prepare it"):
        environment_kwargs(env(data={"verified": str(tmp_path / "verified.jsonl")}))
    with pytest.raises(ConfigError, match="runtime.kind='lxc' is unknown"):
        environment_kwargs(env(runtime={"kind": "lxc"}))


def test_convert_rebench_rows_builds_gradable_instances(generated):
    instance = generated["instances"][3]
    row = {
        key: instance[key] for key in ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement")
    }
    row.update(
        FAIL_TO_PASS=json.dumps(instance["FAIL_TO_PASS"]),  # SWE-rebench stores them as JSON strings
        PASS_TO_PASS=json.dumps(instance["PASS_TO_PASS"]),
        docker_image=instance["image"],
        install_config={"test_cmd": TEST_CMD, "log_parser": "parse_log_pytest"},
    )
    converted = convert_rebench(row)
    assert converted["FAIL_TO_PASS"] == instance["FAIL_TO_PASS"] and ">>>>> Test Exit Code" in converted["eval_script"]
    runtime = build_runtime(RuntimeSettings(kind="bwrap", image_root=str(generated["out"] / "images")))
    assert grade(runtime, converted, converted["patch"], 60).outcome == "resolved"
    assert grade(runtime, converted, instance["test_patch"], 60).outcome == "unresolved"
    with pytest.raises(ValueError, match="needs docker_image and install_config"):
        convert_rebench({**row, "install_config": {}})
    with pytest.raises(ValueError, match="SWE-bench/SWE-bench_Verified"):
        convert_verified({**row, "instance_id": "django__django-11099"})
    verified = convert_verified(
        {**row, "instance_id": "django__django-11099", "eval_script": "x", "log_parser": "parse_log_django"}
    )
    assert verified["image"] == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"


def test_filter_applies_appendix_h_in_order(generated, tiny_path, tmp_path):
    instances = generated["instances"][:5]
    long_statement = {**instances[4], "problem_statement": "word " * 3000}
    rows = [
        *instances[:3],
        generated["broken"]["image_missing"],
        generated["broken"]["wrong_base_commit"],
        {**instances[3], "repo": "django/django"},
        long_statement,
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    command = [
        sys.executable, "-m", "canopy.tools.swe_data", "filter", tmp_path / "in.jsonl", tmp_path / "out.jsonl",
        "--tokenizer", str(tiny_path), "--image-root", str(generated["out"] / "images"), "--check-gold",
        "--max-prompt-tokens", "2048", "--report", str(tmp_path / "report.json"),
    ]  # fmt: skip
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert list(temp.iterdir()) == []  # the check's sandboxes leave nothing behind
    stages = [json.loads(line) for line in run.stdout.splitlines()]
    assert [s["instances"] for s in stages] == [7, 5, 4, 3]
    assert stages[-1]["mean_prompt_tokens"] > 0 and stages[2]["repos"] == 4
    kept = [i["instance_id"] for i in read_jsonl(tmp_path / "out.jsonl")]
    assert kept == [i["instance_id"] for i in instances[:3]]
    dropped = json.loads((tmp_path / "report.json").read_text())["dropped"]
    assert dropped["broken__image-1"] == "(i) image not materialized"
    assert dropped["broken__head-1"].startswith("(i) HEAD ")
    assert dropped[instances[3]["instance_id"]].startswith("(ii) repository django/django")
    assert dropped[instances[4]["instance_id"]].startswith("(iii) prompt ")


def test_cache_images_reports_what_it_could_not_materialize(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither skopeo nor umoci here
    failed = cache_images([{"image": "swerebench/sweb.eval.x86_64.a_1776_b-1:latest"}], tmp_path, "skopeo")
    assert failed == {
        "swerebench/sweb.eval.x86_64.a_1776_b-1:latest": "skopeo is not installed (apt-get install skopeo)"
    }


@pytest.mark.slow
def test_swebench_toy_trains_and_evaluates_end_to_end(generated, tmp_path):
    data = generated["out"]
    dev = [generated["instances"][7], generated["broken"]["image_missing"]]
    write_jsonl(tmp_path / "dev.jsonl", dev)
    overrides = [
        "experiment=swebench_toy",
        f"model.tiny.dir={tmp_path / 'tiny'}",
        "model.tiny.format_warmup_steps=0",
        f"env.swebench.data.train={data / 'train.jsonl'}",
        f"env.swebench.data.dev={tmp_path / 'dev.jsonl'}",
        f"env.swebench.runtime.image_root={data / 'images'}",
    ]
    run = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'run'}", "callbacks.budget_transfer=null", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    from canopy.reports.tb_scalars import read_scalars

    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    assert [value for _, value in scalars["outcome/no_submission"]] == [8.0, 8.0]  # 2 tasks x 4 rollouts, 2 steps
    from canopy.trajectories import read_step

    logged = read_step(tmp_path / "run" / "trajectories" / "train" / "step_000001.jsonl.gz")
    assert len(logged) == 8 and {r["verdict"]["outcome"] for r in logged} == {"no_submission"}
    assert all(r["turns"] and r["scenario"] for r in logged)
    assert logged[0]["task_id"] in (tmp_path / "run" / "viewer.html").read_text()  # the viewer holds SWE episodes
    checkpoint = tmp_path / "run" / "final_hf"
    evaluate = subprocess.run(
        [sys.executable, "evaluate.py", f"hydra.run.dir={tmp_path / 'eval'}", f"checkpoint={checkpoint}", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    (result,) = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["outcomes"] == {"no_submission": 4, "image_unavailable": 4}  # k=4; the missing image scores 0
    assert result["metrics"]["all"]["tasks"] == 2 and result["quarantined"] == 0
    assert set(result["by_scenario"]) == {dev[0]["repo"], dev[1]["repo"]}  # per repository, the unavailable one at 0
    evaluated = read_step(tmp_path / "eval" / "trajectories" / "eval_swe_toy" / "step_000000.jsonl.gz")
    assert sorted(r["verdict"]["outcome"] for r in evaluated) == ["image_unavailable"] * 4 + ["no_submission"] * 4
    from urllib.parse import quote

    from tests.helpers import dom, element

    first = logged[0]  # a SWE-bench episode in the viewer, as a headless Chromium shows it
    address = f"stream=train&step=1&task={quote(first['task_id'], safe='')}&sample={first['sample_index']}"
    shown = element(dom(tmp_path / "run" / "viewer.html", address, tmp_path), "episode-view")
    assert f"<td>{first['task_id']}</td>" in shown and shown.count('class="turn action"') == first["num_turns"]
    assert (tmp_path / "eval" / "viewer.html").is_file()


def container_base(executable: str) -> str | None:
    """A base image for the generated tasks (bash, git, python3, pytest) in `executable`'s store, when it answers:
    docs/environments.md, "SWE-bench" (debootstrap + import). CI machines have neither daemon: there these tests are
    skipped."""
    base = os.environ.get("CANOPY_SWE_CONTAINER_BASE", "canopy/swe-base:bookworm")
    if shutil.which(executable) is None:
        return None
    probe = subprocess.run([executable, *container_flags(executable), "image", "inspect", base], capture_output=True)
    return base if probe.returncode == 0 else None


def container_flags(executable: str) -> tuple[str, ...]:
    from canopy.envs.isolation.containers import PODMAN_FLAGS

    return PODMAN_FLAGS if executable == "podman" else ()


def containers(executable: str) -> list[str]:
    listing = subprocess.run(
        [executable, *container_flags(executable), "ps", "-aq", "--filter", "label=canopy.slot"],
        capture_output=True,
        text=True,
    )
    return listing.stdout.split()


@pytest.mark.parametrize("executable", ["docker", "podman"])
def test_container_runtimes_score_and_clean_up_like_bwrap(generated, tmp_path, executable):
    base = container_base(executable)
    if base is None:
        pytest.skip(f"needs {executable} answering with the base image (docs/environments.md, SWE-bench)")
    instances = generated["instances"][:2]
    build_container_images(generated["out"], instances, base, executable)
    a, b = instances
    scripts = {
        "resolved": [resolve(a), SUBMIT],
        "unresolved": [wrong_fix(a), SUBMIT],
        "empty_patch": [SUBMIT],
        "fork_bomb": [bash("for i in $(seq 200); do sleep 5 & done; echo forked"), resolve(b), SUBMIT],
        "command_timeout": [bash("sleep 20"), resolve(b), SUBMIT],
        "oom_command": [bash("python3 -c 'x = bytearray(600 * 2**20); print(len(x))'"), resolve(b), SUBMIT],
        "network": [bash(f'python3 -c "{CONNECT}"'), resolve(b), SUBMIT],
    }
    tasks = [tagged(a if k in ("resolved", "unresolved", "empty_patch") else b, k) for k in scripts]
    tokenizer = build_byte_tokenizer()
    runtime = {**settings(generated)["runtime"], "kind": executable, "image_root": None}
    pool = EnvironmentPool(
        "canopy.envs.swebench:SWEBenchEnvironment",
        settings(generated, runtime=runtime),
        PoolSettings(workers=2, memory_mb=4096, operation_timeouts_s={"step": 60, "verdict": 120}),
        scratch_root=tmp_path / "pool",
    )
    try:
        trajectories, _ = run_episodes(
            TaskScriptedEngine(tokenizer, scripts),
            pool,
            tokenizer,
            [(t, 0) for t in tasks],
            BUDGET,
            UNFILTERED,
        )
    finally:
        pool.close()
    outcomes = {t.task.task_id.split("/")[1]: t.verdict.outcome for t in trajectories if t.verdict}
    assert outcomes == {k: k if k in ("resolved", "unresolved", "empty_patch") else "resolved" for k in scripts}
    assert containers(executable) == []  # every sandbox's container removed

    def live():
        assert len(containers(executable)) == 1  # the episode's container, labelled with its slot

    trajectory = kill_worker_mid_command(generated, tmp_path / "killed", runtime, live)
    assert trajectory.quarantine == "worker_killed"
    assert containers(executable) == []  # the killed worker's container was removed with its slot


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="drops from root to nobody")
def test_bwrap_runs_rootless(generated):
    """The bwrap runtime as an unprivileged user: a user namespace maps it to root over its own image copy (as
    `umoci unpack --rootless` leaves it), no cgroups, an address-space cap instead."""
    import tempfile

    image = generated["instances"][0]["image"]
    folder = Path(tempfile.mkdtemp(prefix="canopy-rootless-", dir="/tmp"))
    try:
        folder.chmod(0o755)
        shutil.copytree(
            generated["out"] / "images" / safe_image_name(image),
            folder / "images" / safe_image_name(image),
            symlinks=True,
        )
        code = folder / "code"  # the runtime's stdlib-only modules, where nobody can read them (the checkout may not)
        for module in (
            "canopy/__init__.py",
            "canopy/compat.py",
            "canopy/errors.py",
            "canopy/protocols.py",
            "canopy/envs/__init__.py",
            "canopy/envs/attribution.py",
            "canopy/envs/base.py",
            *(str(path.relative_to(ROOT)) for path in sorted((ROOT / "canopy/envs/isolation").glob("*.py"))),
            "tests/rootless_probe.py",
        ):
            (code / module).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / module, code / module)
        subprocess.run(["chown", "-R", "nobody:nogroup", str(folder)], check=True)
        run = subprocess.run(
            ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", "/usr/bin/python3",
             str(code / "tests" / "rootless_probe.py"), str(folder), image],
            env={"PATH": "/usr/bin:/bin", "HOME": str(folder), "PYTHONPATH": str(code)},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        out = json.loads(run.stdout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert out["rootless"] and not out["cgroups"]
    assert out["head"] == [0, generated["instances"][0]["base_commit"] + "\n"]
    assert out["persist"] == [0, "hello\n?? notes.txt\n"]  # files outlive their command
    assert "Read-only file system" in out["usr"][1] and "Network is unreachable" in out["net"][1]
    assert out["memory"][0] != 0 and "MemoryError" in out["memory"][1]
