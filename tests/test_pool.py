"""The environment serving layer: isolated workers, health checks, repair, and fault attribution (Appendix G)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from canopy.envs import sandbox
from canopy.envs.base import AgentFailure, EnvironmentFault, SystemicFaultError, Verdict
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from tests.helpers import UNFILTERED
from tests.scripted import ScriptedEngine

SANDBOX = {"cpu_seconds": 1, "wall_seconds": 2.0, "memory_mb": 256, "max_processes": 8}
SETTINGS = PoolSettings(workers=2, memory_mb=1024, request_timeout_s=4.0, health_timeout_s=2.0)


@pytest.fixture
def pool():
    pool = EnvironmentPool("canopy.envs.python_tasks:PythonTaskEnvironment", {"sandbox": SANDBOX}, SETTINGS)
    yield pool
    pool.close()


@pytest.fixture
def scratch():
    """A scratch folder for a pool that the sandbox user can reach (pytest's folders are closed to it), under a name
    no other pool's sweep takes for an abandoned pool's."""
    folder = Path(tempfile.mkdtemp(prefix="canopy-test-"))
    folder.chmod(0o711)
    yield folder / "pool"
    shutil.rmtree(folder)


def code(text):
    return f"```python\n{text}\n```"


def test_workers_start_lazily_and_a_correct_answer_passes(pool):
    assert pool.worker_pids() == []
    task = pool.tasks("train")[1]
    assert len(pool.worker_pids()) == 2
    episode = pool.start(task, seed=0)
    assert task.spec["prompt"] in episode.messages()[-1]["content"]
    result = episode.step(code(f"print('hi')\nsubmit({task.spec['answer']!r})"))
    assert result.done and result.observation == "hi\n"
    assert episode.verdict() == Verdict(2, 2)
    episode.close()


def test_errors_are_observations_and_limits_are_agent_failures(pool):
    task = pool.tasks("train")[0]
    episode = pool.start(task, seed=0)
    result = episode.step(code("1 / 0"))
    assert not result.done and "ZeroDivisionError" in result.observation
    assert not episode.step("no code here").done
    with pytest.raises(AgentFailure) as failure:
        episode.step(code("while True:\n    pass"))
    assert failure.value.reason == "agent_timeout"
    episode.close()
    assert len(pool.worker_pids()) == 2  # the agent's fault costs no worker


def test_a_reply_without_a_code_block_is_invalid_across_the_worker_channel(pool):
    """Format health: python tasks' one invalid action is a reply without a code block; code that raises, or does
    not even parse, is a valid action that failed. The flag crosses the worker process boundary with the result."""
    episode = pool.start(pool.tasks("train")[0], seed=0)
    assert [episode.step(reply).valid for reply in ("no code here", "print(1)", "```\nprint(1)\n```")] == [
        False,
        False,
        True,  # a bare ``` block is a code block too
    ]
    assert episode.step(code("1 / 0")).valid and episode.step(code("def (")).valid
    episode.close()


def test_killed_worker_is_quarantined_and_replaced(pool):
    episode = pool.start(pool.tasks("train")[0], seed=0)
    victim = episode.host.pid
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(EnvironmentFault) as fault:
        episode.step(code("print(1)"))
    assert fault.value.reason == "worker_killed"
    episode.close()
    assert victim not in pool.worker_pids() and len(pool.worker_pids()) == 2


def test_stopped_worker_is_unresponsive(pool):
    episode = pool.start(pool.tasks("train")[0], seed=0)
    os.kill(episode.host.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(EnvironmentFault) as fault:
        episode.step(code("print(1)"))
    assert fault.value.reason == "worker_unresponsive"
    assert SETTINGS.request_timeout_s <= time.monotonic() - started < SETTINGS.request_timeout_s + 3
    episode.close()


def test_dead_idle_worker_is_repaired_by_the_health_check(pool):
    tasks = pool.tasks("train")
    for pid in pool.worker_pids():
        os.kill(pid, signal.SIGKILL)
    episode = pool.start(tasks[0], seed=0)  # no episode is harmed: the check runs before the worker takes one
    assert episode.step(code(f"submit({tasks[0].spec['answer']!r})")).done
    episode.close()
    assert pool.repairs >= 1


def test_requests_for_another_episode_are_corruption(pool):
    tasks = pool.tasks("train")
    first, second = pool.start(tasks[0], seed=0), pool.start(tasks[1], seed=1)
    first.host, second.host = second.host, first.host  # a mis-route
    with pytest.raises(EnvironmentFault) as fault:
        first.step(code("print(1)"))
    assert fault.value.reason == "cross_episode_corruption"
    first.close()
    second.close()


OWNER_KILLED_MID_SANDBOX = """
import json, os, threading, time
import canopy.envs.sandbox
canopy.envs.sandbox.FIRST_UID = {first_uid}
from canopy.envs.pool import EnvironmentPool, PoolSettings
pool = EnvironmentPool("canopy.envs.python_tasks:PythonTaskEnvironment",
    {{"sandbox": {{"cpu_seconds": 5, "wall_seconds": 6.0, "memory_mb": 256, "max_processes": 8}}}},
    PoolSettings(workers=1, memory_mb=1024, request_timeout_s=20.0), scratch_root={scratch!r})
episode = pool.start(pool.tasks("train")[0], seed=0)
print(json.dumps([episode.host.pid, episode.host.uid]), flush=True)
threading.Thread(target=episode.step, args=("```python\\nimport time; time.sleep(3)\\n```",)).start()
time.sleep(1.0)
os.kill(os.getpid(), 9)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are claimed only when running as root")
def test_a_worker_orphaned_mid_sandbox_keeps_its_uid_until_it_exits(monkeypatch, scratch):
    """A pool killed with -9 leaves its worker running its sandbox, which ends by killing every process of the
    sandbox uid. Until that worker exits its uid must stay claimed, or the next claimant's processes die with it
    (a Ray node's sandbox Python probe once did, in CI). Finding nobody to reply to, the worker closes its
    episode (its folder goes) and exits without an error."""
    first_uid = 70000 + os.getpid() % 10000 * 10  # a range of our own: the claim order below is then certain
    monkeypatch.setattr(sandbox, "FIRST_UID", first_uid)
    owner = subprocess.run(
        [sys.executable, "-c", OWNER_KILLED_MID_SANDBOX.format(first_uid=first_uid, scratch=str(scratch))],
        capture_output=True,
        text=True,
    )
    assert owner.returncode == -signal.SIGKILL, owner.stderr
    orphan, orphan_uid = json.loads(owner.stdout)
    assert orphan_uid == first_uid and os.path.exists(f"/proc/{orphan}")  # still in its sandbox

    uid, lock = sandbox.claim_uid()
    try:
        assert uid != orphan_uid
        bystander = subprocess.Popen(["sleep", "5"], user=uid, group=uid, extra_groups=[])
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{orphan}")  # it finished its sandbox, cleaned up its uid, and left
        assert bystander.wait() == 0
    finally:
        os.close(lock)
    assert list((scratch / "w0" / "python_tasks").iterdir()) == []  # the episode was closed
    assert "Traceback" not in (scratch / "logs" / "worker0.log").read_text()


POOL_OWNER = """
import os, sys
from canopy.envs.pool import EnvironmentPool, PoolSettings
pool = EnvironmentPool("canopy.envs.embedded:EmbeddedEnvironment", {{}}, PoolSettings(workers=1, request_timeout_s=30))
pool.tasks("train")
(pool.scratch_root / "w0" / "container-runtime").write_text({runtime!r})  # as a docker sandbox marks its slot
print(pool.scratch_root, pool.worker_pids()[0], flush=True)
{ending}
"""


def test_a_pool_killed_before_close_is_cleaned_up_by_the_next_pool_to_start(tmp_path, monkeypatch):
    """kill -9 leaves a pool's scratch folder and its sandboxes' containers behind (a preempted job, the OOM
    killer); the next pool to start on the machine removes both, and leaves alone the folders of a live pool, of a
    pool still starting and of no pool. Its orphaned worker exits."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    calls, runtime = tmp_path / "runtime.log", tmp_path / "docker"
    runtime.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1" = ps ] && echo c0ffee\nexit 0\n')
    runtime.chmod(0o755)

    def owner(ending: str) -> tuple[subprocess.Popen, Path, int]:
        script = POOL_OWNER.format(runtime=str(runtime), ending=ending)
        process = subprocess.Popen(
            [sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(temp)}, stdin=-1, stdout=-1, text=True
        )
        root, worker = process.stdout.readline().split()
        return process, Path(root), int(worker)

    live, live_root, _ = owner("sys.stdin.read()\npool.close()")
    killed, dead_root, orphan = owner("os.kill(os.getpid(), 9)")
    assert killed.wait() == -signal.SIGKILL and dead_root.is_dir()
    starting = temp / "canopy-envs-1-0"  # its owner has created the lock file, not yet taken it
    starting.mkdir()
    (starting / ".owner").touch()
    not_a_pool = temp / "canopy-envs-notes"
    not_a_pool.mkdir()

    pool = EnvironmentPool("canopy.envs.embedded:EmbeddedEnvironment", {}, PoolSettings(workers=1))
    try:
        pool.tasks("train")
    finally:
        pool.close()
    assert not dead_root.exists()
    assert calls.read_text().splitlines() == [f"ps -aq --filter label=canopy.slot={dead_root.name}-w0", "rm -f c0ffee"]
    assert live_root.is_dir() and starting.is_dir() and not_a_pool.is_dir()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{orphan}")
    live.communicate("")
    assert live.returncode == 0 and not live_root.exists()
    assert sorted(p.name for p in temp.iterdir()) == ["canopy-envs-1-0", "canopy-envs-notes"]


def test_a_scratch_folder_serves_one_live_pool(tmp_path):
    """Two pools given one scratch folder would clear each other's sandboxes: the second stops in one line, and
    closing it leaves the first one's folder alone."""
    first, second = (
        EnvironmentPool("canopy.envs.embedded:EmbeddedEnvironment", {}, PoolSettings(workers=1), scratch_root=tmp_path)
        for _ in range(2)
    )
    try:
        first.tasks("train")
        with pytest.raises(SystemicFaultError, match=rf"belongs to a live pool \(pid {os.getpid()}\): give each pool"):
            second.tasks("train")
        second.close()
        assert (tmp_path / "w0").is_dir() and first.tasks("train")
    finally:
        first.close()


def test_broken_environment_factory_fails_loudly():
    pool = EnvironmentPool("canopy.envs.no_such_module:Nothing", {}, SETTINGS)
    with pytest.raises(RuntimeError, match="failed to start"):
        pool.tasks("train")
    pool.close()


class TurnScriptedEngine(ScriptedEngine):
    """Replies by the episode's own turn (not by call count), so how episodes are batched does not matter."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, ["login", "key", "unlock", "open"])
        self.assistant = tokenizer.convert_tokens_to_ids("assistant")

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        out = []
        for prompt, limit in zip(prompts, max_new_tokens):
            self.calls = [None] * (prompt.count(self.assistant) - 1)  # the k-th turn gets replies[k - 1]
            out += super().generate([prompt], [limit], sampling)
        return out


def test_embedded_env_behind_the_pool_matches_in_process(tokenizer):
    """Same tasks, same scripted actions: the pool changes where episodes run, not what happens in them."""
    budget = Budget(
        max_turns=4, max_response_tokens=64, max_prompt_tokens=128, max_observation_tokens=32, max_context_tokens=1024
    )
    env = EmbeddedEnvironment()
    jobs = [(task, 0) for task in env.tasks("train")[:6]]
    local, _ = run_episodes(
        TurnScriptedEngine(tokenizer),
        env,
        tokenizer,
        jobs,
        budget,
        UNFILTERED,
    )
    pool = EnvironmentPool(
        "canopy.envs.embedded:EmbeddedEnvironment", {}, PoolSettings(workers=4, request_timeout_s=30)
    )
    try:
        pooled, _ = run_episodes(
            TurnScriptedEngine(tokenizer),
            pool,
            tokenizer,
            jobs,
            budget,
            UNFILTERED,
        )
    finally:
        pool.close()
    assert [(t.ending, t.verdict, t.token_ids) for t in pooled] == [(t.ending, t.verdict, t.token_ids) for t in local]


@pytest.mark.slow
def test_fault_soak_misclassifies_and_loses_nothing():
    from canopy.envs.fault_injection import INFRA_FAULTS
    from canopy.tools.fault_soak import AGENT_FAULTS, attribution_line, serving_faults, soak, soak_line

    counts, rows = soak(episodes=150, workers=6, fault_rate=0.7, seed=1)
    print(soak_line(counts), attribution_line(counts), sep="\n")
    kinds = {job.kind for job, _, _ in rows}
    assert set(serving_faults()) | set(AGENT_FAULTS) <= kinds  # every kind was injected
    assert not counts["agent_quarantined"] and not counts["serving_scored"], attribution_line(counts)
    assert counts["misclassified"] == 0 and counts["lost"] == 0
    assert counts["quarantined"] == sum(job.kind in INFRA_FAULTS for job, _, _ in rows)
    assert soak_line(counts).endswith("0 misclassified, 0 lost")
