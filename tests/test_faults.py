"""A broken setup stops the run; quarantine is for rare faults (Appendix G). Pool slots survive failed restarts."""

import os
import signal
from pathlib import Path

import pytest

from canopy.envs.base import EnvironmentFault, SystemicFaultError, Task, Verdict
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.eval.runner import sample_runs
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.engine import EngineFault
from canopy.rollout.faults import check_systemic_faults
from canopy.rollout.trajectory import Trajectory
from tests.faulty_envs import FailingEnvironment
from tests.helpers import UNFILTERED, datamodule
from tests.scripted import ScriptedEngine

BUDGET = Budget(
    max_turns=4, max_response_tokens=64, max_prompt_tokens=128, max_observation_tokens=32, max_context_tokens=512
)


def episode(i: int, fault: EnvironmentFault | EngineFault | None = None) -> Trajectory:
    t = Trajectory(Task(f"t{i}", 1, "s"), 0, [1, 2], [0, 1], [0.0, 0.0], 1)
    if fault is None:
        t.verdict, t.ending = Verdict(1, 1), "done"
    else:
        t.quarantine_for(fault)
    return t


def test_most_episodes_quarantined_stops_with_the_dominant_reason_and_first_message():
    faults = [EnvironmentFault("worker_killed", "worker 0: died of SIGKILL", worker=0)] + [
        EnvironmentFault(
            "server_request_failed", f"/initialize answered 500:\nTraceback\nPermissionError: '/h/.ipython' (log {i})"
        )
        for i in range(5)
    ]
    trajectories = [episode(0), *(episode(i + 1, f) for i, f in enumerate(faults)), episode(7), episode(8), episode(9)]
    check_systemic_faults(
        trajectories, max_fraction=0.6, workers=None, what="step 3"
    )  # 6 of 10: at the threshold, not above it
    with pytest.raises(SystemicFaultError) as stop:
        check_systemic_faults(trajectories, max_fraction=0.5, workers=None, what="rollout step 3")
    message = str(stop.value)
    assert "\n" not in message
    assert "6 of 10 episodes of rollout step 3 were quarantined (> env.max_quarantine_fraction=0.5)" in message
    assert "5 of them server_request_failed" in message
    assert "first: /initialize answered 500: Traceback PermissionError: '/h/.ipython' (log 0)" in message
    assert "Fix the environment's setup" in message


def test_the_same_fault_on_every_worker_stops_below_the_threshold():
    def faulted(i, worker, reason="worker_crashed"):
        return episode(i, EnvironmentFault(reason, f"worker {worker}: exited with status 1", worker=worker))

    healthy = [episode(100 + i) for i in range(20)]
    twice_each = [faulted(0, 0), faulted(1, 1), faulted(2, 0), faulted(3, 1)]
    with pytest.raises(
        SystemicFaultError, match="worker_crashed quarantined >= 2 episodes on every one of the 2 workers"
    ):
        check_systemic_faults(healthy + twice_each, max_fraction=0.5, workers=2, what="step 0")
    check_systemic_faults(healthy + twice_each, max_fraction=0.5, workers=3, what="step 0")  # worker 2 never had it
    check_systemic_faults(healthy + twice_each[:3], max_fraction=0.5, workers=2, what="step 0")  # once on worker 1
    mixed = [faulted(0, 0), faulted(1, 1), faulted(2, 0, "worker_killed"), faulted(3, 1, "worker_killed")]
    check_systemic_faults(healthy + mixed, max_fraction=0.5, workers=2, what="step 0")  # no reason repeats everywhere
    engine_faults = [episode(i, EngineFault("engine_request_failed", "server 0 timed out")) for i in range(4)]
    check_systemic_faults(
        healthy + engine_faults, max_fraction=0.5, workers=2, what="step 0"
    )  # no worker: fraction only


def test_training_step_stops_when_the_environment_setup_is_broken(tokenizer):
    engine = ScriptedEngine(tokenizer, ["login"])
    dm = datamodule(tokenizer, engine, group_size=2)
    dm.env = FailingEnvironment()
    with pytest.raises(
        SystemicFaultError, match=r"6 of 6 episodes of rollout step 0 .*server_request_failed.*Permission denied"
    ):
        dm.next_batch()


def test_a_rare_fault_is_quarantined_and_training_goes_on(tokenizer):
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login"]), group_size=2)
    first = dm.sample_tasks()[0]
    dm.sampler_state = {"epoch": 0, "position": 0}
    dm.env = FailingEnvironment(failing={first.task_id})  # 2 of 6 episodes: below the default 0.5
    batch = dm.next_batch()
    assert batch.metrics["rollout/quarantined"] == 2 and batch.metrics["quarantine/server_request_failed"] == 2
    dm.max_quarantine_fraction = 0.25
    dm.sampler_state = {"epoch": 0, "position": 0}
    with pytest.raises(SystemicFaultError, match="2 of 6 episodes of rollout step 1"):
        dm.next_batch()


def test_evaluation_stops_too(tokenizer):
    env = FailingEnvironment()
    with pytest.raises(SystemicFaultError, match="of eval base were quarantined"):
        sample_runs(
            ScriptedEngine(tokenizer, ["login"]),
            env,
            tokenizer,
            env.tasks("dev")[:3],
            2,
            BUDGET,
            UNFILTERED,
            description="eval base",
        )


SETTINGS = PoolSettings(workers=2, memory_mb=1024, request_timeout_s=20.0, health_timeout_s=5.0, start_timeout_s=60.0)


def test_pool_faults_name_their_worker_and_stop_the_step(tokenizer, tmp_path):
    """Through real worker processes: the fault's slot and detail cross the channel intact."""
    pool = EnvironmentPool("tests.faulty_envs:FailingEnvironment", {}, SETTINGS, log_dir=tmp_path / "logs")
    try:
        tasks = pool.tasks("train")[:2]
        trajectories, _ = run_episodes(
            ScriptedEngine(tokenizer, ["login"]),
            pool,
            tokenizer,
            [(t, i) for t in tasks for i in range(2)],
            BUDGET,
            UNFILTERED,
        )
    finally:
        pool.close()
    assert {t.quarantine for t in trajectories} == {"server_request_failed"}
    assert {t.fault.worker for t in trajectories} <= {0, 1}
    assert all(
        t.fault.detail.startswith(f"worker {t.fault.worker} (pid ") and "Permission denied" in t.fault.detail
        for t in trajectories
    )
    with pytest.raises(SystemicFaultError, match="4 of 4 episodes"):
        check_systemic_faults(trajectories, 0.5, pool.max_concurrent_episodes, "rollout step 0")


def test_a_replacement_worker_that_cannot_start_leaves_its_slot_vacant_not_lost(tmp_path):
    """The old pool raised out of `close()` and lost the slot (a pool of lost slots waits forever): now the
    next episode on that slot is quarantined with the worker's own error and its log, and the slot heals."""
    gate = tmp_path / "gate"
    gate.touch()
    pool = EnvironmentPool(
        "tests.faulty_envs:GatedEnvironment", {"gate": str(gate)}, SETTINGS, log_dir=tmp_path / "logs"
    )
    try:
        tasks = pool.tasks("train")
        episode = pool.start(tasks[0], seed=0)
        os.kill(episode.host.pid, signal.SIGKILL)
        with pytest.raises(EnvironmentFault, match="worker_killed"):
            episode.step("login")
        gate.unlink()  # the setup breaks: no replacement can start
        episode.close()  # the replacement fails to start here; the episode's outcome is already decided
        assert len(pool.worker_pids()) == 1
        faults = []
        for i in range(4):  # both slots serve episodes: the vacant one quarantines each it is given
            try:
                pool.start(tasks[i], seed=i).close()
            except EnvironmentFault as fault:
                faults.append(fault)
        assert faults and all(f.reason == "worker_start_failed" and f.worker is not None for f in faults)
        assert "setup broke" in faults[0].detail and "worker log: " in faults[0].detail
        kept = Path(faults[0].detail.rsplit("worker log: ", 1)[1].rstrip(")"))
        assert kept.parent == tmp_path / "logs" and "setup broke" in kept.read_text()
        gate.touch()  # fixed: the vacant slot starts again
        for i in range(4):
            pool.start(tasks[i], seed=i).close()
        assert len(pool.worker_pids()) == 2
    finally:
        pool.close()
