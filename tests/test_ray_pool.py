"""Environments on the nodes of a Ray cluster: spread, fault attribution across nodes, lost nodes, config."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from canopy.build import build_env
from canopy.config import compose_config, validate
from canopy.envs import ray_pool
from canopy.envs.base import AgentFailure, EnvironmentFault, SystemicFaultError, Task
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.envs.ray_pool import RayEnvironment, RaySettings
from canopy.errors import ConfigError
from canopy.reports.tb_scalars import read_scalars
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from tests.helpers import UNFILTERED, train
from tests.scripted import ScriptedEngine

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)  # a cluster that stops answering fails its test, never holds the suite

ROOT = Path(__file__).resolve().parents[1]
PYTHON_TASKS = "canopy.envs.python_tasks:PythonTaskEnvironment"
SANDBOX = {"cpu_seconds": 1, "wall_seconds": 2.0, "memory_mb": 256, "max_processes": 8}
SETTINGS = PoolSettings(workers=2, memory_mb=1024, request_timeout_s=4.0, health_timeout_s=2.0)
NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}  # small, so that the cluster starts fast on 2 cores
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}  # a crashed node: dead in ~3 s


@pytest.fixture(scope="module")
def cluster():
    """Ray's own multi-node test cluster on this machine: a head node and one more node."""
    from ray.cluster_utils import Cluster

    scratch = Path(tempfile.mkdtemp(prefix="canopy-ray-nodes-"))
    scratch.chmod(0o711)  # sandbox users reach their episodes' folders below it
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(ROOT), prepend=os.pathsep)  # the nodes import this checkout's canopy
        patch.setenv("RAY_TMPDIR", tempfile.gettempdir())  # Ray's own sockets where they always are
        patch.setenv("TMPDIR", str(scratch))  # what the nodes' pools leave (a lost node's too) goes with the cluster
        head = {**NODE, "include_dashboard": False, "_system_config": HEALTH_CHECKS}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            cluster.add_node(**NODE)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def connected(cluster):
    """This process joined to the cluster before the test adds nodes (so it never joins through one it removes)."""
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()


@pytest.fixture
def extra(connected):
    """One more node, for the test to lose; afterwards it is gone and counted dead, however the test ended, so that
    the next test's environment never places an actor on it."""
    node = connected.add_node(**NODE)
    connected.wait_for_nodes()
    yield node
    if node in connected.worker_nodes:
        connected.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 60  # a crashed node fails its health checks for a few seconds first
    while any(info["NodeID"] == node.node_id and info["Alive"] for info in ray.nodes()):
        assert time.monotonic() < deadline, f"the cluster still counts the removed node {node.node_id} alive"
        time.sleep(0.5)


def code(text):
    return f"```python\n{text}\n```"


def kill(actor) -> None:
    """`ray.kill`, then wait until the actor is dead: the kill reaches the actor's worker asynchronously, so a call
    made at once can still be answered (the last check of the lost-node test once saw no fault under load)."""
    ray.kill(actor)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_call__.remote(lambda actor: None), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.1)
    raise AssertionError("a Ray actor outlived ray.kill by 60 s")


def config(*overrides):
    return compose_config(overrides)


def submit_all(env, tasks):
    """Each task's verdict after one submission (the right answer for every other task) and the node it ran on,
    with as many episodes open at once as the environment has workers."""
    verdicts, nodes = [], []
    width = env.max_concurrent_episodes
    for first in range(0, len(tasks), width):
        chunk = tasks[first : first + width]
        episodes = [env.start(task, seed=0) for task in chunk]
        for index, (task, episode) in enumerate(zip(chunk, episodes), start=first):
            answer = task.spec["answer"] if index % 2 == 0 else "wrong"
            assert episode.step(code(f"submit({answer!r})")).done
            verdicts.append(episode.verdict())
            nodes.append(getattr(episode.host, "node_id", None))  # None: a pool worker
        for episode in episodes:
            episode.close()
    return verdicts, nodes


@pytest.mark.slow
def test_episodes_spread_over_the_nodes_with_the_verdicts_of_one_pool(cluster):
    env = RayEnvironment(PYTHON_TASKS, {"sandbox": SANDBOX}, SETTINGS, RaySettings(address=cluster.address))
    try:
        tasks = env.tasks("train")[:6]
        assert env.max_concurrent_episodes == 4  # 2 nodes x 2 workers
        pinned = [node.node_id for node in env.nodes]
        placed = [ray.get(node.actor.ready.remote()) for node in env.nodes]
        verdicts, nodes = submit_all(env, tasks)
    finally:
        env.close()
    assert placed == pinned and len(set(pinned)) == 2  # each actor runs on the node it was pinned to
    assert set(nodes) == set(pinned)  # both nodes served episodes
    assert not ray.is_initialized()  # the environment connected, so it disconnected; the cluster lives on
    pool = EnvironmentPool(PYTHON_TASKS, {"sandbox": SANDBOX}, SETTINGS)
    try:
        local, _ = submit_all(pool, tasks)
    finally:
        pool.close()
    assert verdicts == local and {v.success for v in verdicts} == {True, False}


def on_the_added_node(episodes, cluster):
    return next(e for e in episodes if e.host.node_id != cluster.head_node.node_id)


@pytest.mark.slow
def test_faults_on_a_remote_node_arrive_as_themselves(connected):
    cluster = connected
    killing = Task("kill", 1, "s", {"prompt": "Submit 1.", "answer": "1", "inject": "kill9", "phase": "step"})
    plain = Task("plain", 1, "s", {"prompt": "Submit 1.", "answer": "1"})
    env = RayEnvironment(
        "canopy.envs.fault_injection:FaultInjectingEnvironment",
        {"sandbox": SANDBOX},
        SETTINGS,
        RaySettings(address=cluster.address, workers_per_node=1),
    )
    try:
        episodes = [env.start(killing, seed=0) for _ in range(2)]  # one on each node
        remote = on_the_added_node(episodes, cluster)
        with pytest.raises(EnvironmentFault) as fault:
            remote.step(code("print(1)"))
        assert fault.value.reason == "worker_killed" and remote.host.name in fault.value.detail
        assert fault.value.worker == remote.host.index  # slot 0 of that node, numbered over the cluster
        for episode in episodes:
            episode.close()
        episodes = [env.start(plain, seed=0) for _ in range(2)]
        with pytest.raises(AgentFailure) as failure:
            on_the_added_node(episodes, cluster).step(code("import os\nos.abort()"))
        assert failure.value.reason == "agent_crashed"
        for episode in episodes:
            episode.close()
    finally:
        env.close()
    assert ray.is_initialized()  # joined before: the environment leaves it joined
    broken = RayEnvironment(
        "canopy.envs.no_such_module:Nothing", {}, SETTINGS, RaySettings(address=cluster.address, workers_per_node=1)
    )
    try:
        with pytest.raises(SystemicFaultError, match="on Ray node .* worker for canopy.envs.no_such_module"):
            broken.tasks("train")  # a node's workers cannot start: a broken setup stops the run
    finally:
        broken.close()


@pytest.mark.slow
def test_a_lost_node_quarantines_its_episodes_and_takes_no_new_ones(connected, extra):
    cluster = connected
    env = RayEnvironment(
        PYTHON_TASKS, {"sandbox": SANDBOX}, SETTINGS, RaySettings(address=cluster.address, workers_per_node=1)
    )
    try:
        tasks = env.tasks("train")
        episodes = [env.start(task, seed=0) for task in tasks[:3]]  # one on each of the 3 nodes
        lost = next(e for e in episodes if e.host.node_id == extra.node_id)
        actor_pid = ray.get(lost.host.actor.__ray_call__.remote(lambda actor: os.getpid()))
        cluster.remove_node(extra, allow_graceful=False)  # the node crashes: its processes die at once, the
        with contextlib.suppress(ProcessLookupError):  # actor's too (its worker notices its raylet's end by itself,
            os.kill(actor_pid, signal.SIGKILL)  # but only a moment later, or already has)
        with pytest.raises(EnvironmentFault) as fault:
            lost.step(code("print(1)"))
        assert fault.value.reason == "node_lost" and extra.node_id[:12] in fault.value.detail
        lost.close()
        for episode in episodes:
            if episode is not lost:
                assert episode.step(code("print(1)")).observation == "1\n"
                episode.close()
        later = [env.start(task, seed=0) for task in tasks[3:5]]
        assert {e.host.node_id for e in later} == {n.node_id for n in env.nodes} - {extra.node_id}
        for episode in later:
            episode.close()
        for node in env.nodes:
            kill(node.actor)  # every actor lost: one episode each finds out, then the run stops
        for _ in range(2):
            with pytest.raises(EnvironmentFault, match="node_lost"):
                env.start(tasks[0], seed=0)
        with pytest.raises(SystemicFaultError, match="every Ray node of the environment was lost"):
            env.start(tasks[0], seed=0)
    finally:
        env.close()


@pytest.mark.slow
def test_a_node_that_does_not_answer_in_time_is_lost(connected, monkeypatch):
    pool_timeout = ray_pool.call_timeout  # a step's: the worker's request timeout, a worker restart, and 30 s more
    monkeypatch.setattr(
        ray_pool, "call_timeout", lambda settings, op: 3.0 if op == "step" else pool_timeout(settings, op)
    )
    env = RayEnvironment(
        PYTHON_TASKS, {"sandbox": SANDBOX}, SETTINGS, RaySettings(address=connected.address, workers_per_node=1)
    )
    try:
        task = env.tasks("train")[0]
        episodes = [env.start(task, seed=0) for _ in range(2)]
        hung = episodes[0]
        os.kill(ray.get(hung.host.actor.__ray_call__.remote(lambda actor: os.getpid())), signal.SIGSTOP)
        with pytest.raises(EnvironmentFault) as fault:
            hung.step(code("print(1)"))
        assert fault.value.reason == "node_lost" and "GetTimeoutError" in fault.value.detail
        with pytest.raises(ray.exceptions.RayActorError):  # killed, so that it cannot come back half-way
            ray.get(hung.host.actor.ready.remote(), timeout=60)
        survivor = episodes[1].host
        for episode in episodes:
            episode.close()
        later = env.start(task, seed=0)
        assert later.host is survivor
        later.close()
    finally:
        env.close()


class NodeRemovingEngine(ScriptedEngine):
    """Removes a node of the cluster (once episodes are open on it, and gracefully) while the rollout runs."""

    def __init__(self, tokenizer, cluster, node, env):
        super().__init__(tokenizer, ["hello"])
        self.cluster, self.node, self.env, self.removed = cluster, node, env, False

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        victim = next(n for n in self.env.nodes if n.node_id == self.node.node_id)
        if not self.removed and victim.open > 0:
            self.cluster.remove_node(self.node)
            self.removed = True
        return super().generate(prompts, max_new_tokens, sampling, keys)


@pytest.mark.slow
def test_a_rollout_loses_no_episode_to_a_lost_node(connected, extra, tokenizer):
    cluster = connected
    env = RayEnvironment(
        "canopy.envs.embedded:EmbeddedEnvironment",
        {},
        SETTINGS,
        RaySettings(address=cluster.address, workers_per_node=1),
    )
    budget = Budget(
        max_turns=2, max_response_tokens=64, max_prompt_tokens=128, max_observation_tokens=32, max_context_tokens=1024
    )
    try:
        jobs = [(task, 0) for task in env.tasks("train")[:8]]
        engine = NodeRemovingEngine(tokenizer, cluster, extra, env)
        trajectories, _ = run_episodes(engine, env, tokenizer, jobs, budget, UNFILTERED)
        assert engine.removed and all(node.open == 0 for node in env.nodes)
    finally:
        env.close()
    assert [(t.task, t.sample_index) for t in trajectories] == jobs  # every job came back
    quarantined = [t for t in trajectories if t.quarantine is not None]
    assert quarantined and {t.quarantine for t in quarantined} == {"node_lost"}
    assert all(t.verdict is not None and t.ending == "turn_limit" for t in trajectories if t.quarantine is None)
    assert len(quarantined) < len(jobs)  # the surviving nodes ran the rest


@pytest.mark.slow
def test_train_py_runs_its_episodes_on_the_cluster(cluster, tmp_path, warm_tiny):
    """`python train.py env.pool.workers=1 env.ray.address=<cluster>`: the embedded default joins the cluster, runs
    its rollout steps in the nodes' pools, trains and leaves cleanly."""
    run_dir, run = train(
        tmp_path,
        warm_tiny,
        2,
        "env.pool.workers=1",
        f"env.ray.address={cluster.address}",
        "callbacks=none",
        "report.eval_samples_per_task=0",
    )
    assert "Connecting to existing Ray cluster" in run.stderr
    scalars = read_scalars(run_dir / "tensorboard")
    assert [v for _, v in scalars["rollout/episodes"]] == [16.0, 16.0]
    assert [v for _, v in scalars["rollout/quarantined"]] == [0.0, 0.0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["env.ray.address=auto"], "env.pool.workers=0 .*: set env.pool.workers >= 1"),
        (["env.ray.address=auto", "env.pool.workers=2", "env.ray.nodes=0"], "env.ray.nodes=0 must be"),
        (["env.ray.address=auto", "env.pool.workers=2", "env.ray.workers_per_node=0"], "env.ray.workers_per_node"),
    ],
)
def test_ray_settings_fail_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(config(*overrides))


def test_a_mistyped_ray_setting_fails_at_composition():
    """`env.ray.*` has a schema (RaySettings): a count that is not one fails before validation, naming the key."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as error:
        config("env.ray.nodes=two")
    assert "full_key: env.ray.nodes" in str(error.value.__cause__)


def test_missing_ray_is_one_line_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    with pytest.raises(ConfigError, match=r"ray package is missing: pip install ray==2\.52\.0"):
        validate(config("env.ray.address=auto", "env.pool.workers=2"))


def test_ray_address_builds_a_ray_environment_that_joins_on_first_use():
    cfg = config("env.name=python_tasks", "env.pool.workers=2", "env.ray.address=auto", "env.ray.workers_per_node=3")
    validate(cfg)
    env = build_env(cfg)
    assert isinstance(env, RayEnvironment) and env.settings.workers == 3 and env.nodes == []
    assert env.settings.request_timeout_s == cfg.env.pool.request_timeout_s


def test_one_machine_never_imports_ray():
    script = (
        "import sys\n"
        "from canopy.config import compose_config\n"
        "from canopy.envs.serving import check_serving\n"
        "check_serving(compose_config(['env.pool.workers=2']).env)\n"
        "assert 'ray' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=120)
