"""Environments past one node: episodes served by the nodes of a Ray cluster (`env.ray.*`).

`RayEnvironment` is an `Environment` whose episodes run on the nodes of a Ray cluster: one `NodePool` actor per
node, pinned there, hosts the node's own `EnvironmentPool` (the same factory, keyword arguments and `PoolSettings`,
so the same isolated workers, sandboxes and fault attribution run on every node). A new episode goes to the live
node with the fewest open episodes; its `RemoteEpisode` sends each call to that node's actor.

Faults keep their attribution across nodes: an `EnvironmentFault`, `AgentFailure` or `SystemicFaultError` raised
on a node reaches the caller as itself, unwrapped from Ray's `RayTaskError`. An `EnvironmentFault` names its node
in its detail (the worker's kept log is on that node) and its worker is numbered over the cluster (node i's slot s
is worker i * workers_per_node + s), so that `check_systemic_faults` sees every worker of every node. A node whose
actor dies (the node died, or was removed) or does not answer within its pool's longest path for the call plus a
margin is lost: its open episodes end in `EnvironmentFault("node_lost")` (quarantined), it takes no new episodes,
and once every node is lost the next episode stops the run (`SystemicFaultError`).

Concurrency: `max_concurrent_episodes` is the workers of the nodes whose actor started on joining the cluster. A
lost node's share stays counted; `start` waits for a free worker on a live node instead.

Ray is optional: it is imported only when `env.ray.address` is set. The cluster is joined and the actors placed on
first use (only the generating rank uses the environment). `close()` stops the pools and their actors, and
disconnects from the cluster if this environment connected, never stopping the cluster itself.
"""

import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from canopy.envs.base import AgentFailure, EnvironmentFault, SystemicFaultError, Task, last_line
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.envs.remote import RemoteEpisode
from canopy.errors import ConfigError, is_int, require

MARGIN_S = 30.0  # past a call's longest path on a healthy node, the node counts as lost
INSTALL_RAY = "pip install ray==2.52.0"


@dataclass(frozen=True)
class RaySettings:
    """`env.ray.*`: the schema and the only defaults of those keys (docs/scale.md)."""

    address: str | None = None  # null = no Ray (one machine); auto = the running cluster (`ray start`); or host:port
    nodes: int | None = None  # null = every alive node with CPUs; N = the first N of them
    workers_per_node: int | None = None  # null = env.pool.workers (which must be >= 1 with Ray)


def import_ray():
    """The ray package, or a one-line `ConfigError` naming the fix."""

    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"env.ray.address is set but the ray package is missing: {INSTALL_RAY}, or set env.ray.address=null"
        ) from None
    return ray


def validate(env) -> None:
    """`env.ray.*`: one line naming the fix on the first bad value; with Ray on, the pool and the ray package."""

    address, nodes, workers = env.ray.address, env.ray.nodes, env.ray.workers_per_node
    require(
        nodes is None or (is_int(nodes) and nodes >= 1),
        f"env.ray.nodes={nodes} must be null (every alive node with CPUs) or the number of nodes to use (>= 1)",
    )
    require(
        workers is None or (is_int(workers) and workers >= 1),
        f"env.ray.workers_per_node={workers} must be null (env.pool.workers) or the workers of each node (>= 1)",
    )
    if address is None:
        return
    require(
        isinstance(address, str) and address != "",
        f"env.ray.address={address!r} must be null (no Ray), auto (the running cluster) or the head's host:port",
    )
    require(
        env.pool.workers >= 1,
        f"env.ray.address={address} runs the environment's worker pools on Ray nodes, but env.pool.workers=0 "
        "(in-process): set env.pool.workers >= 1 (the workers of each node unless env.ray.workers_per_node)",
    )
    import_ray()


def call_timeout(settings: PoolSettings, op: str) -> float:
    """How long `op` may take on a healthy node: the request's own timeout, plus the health checks and worker starts
    the node's pool may run first (all its workers on first use, for `tasks` and `start`) or after, plus a margin."""
    rounds = settings.workers + 2 if op in ("tasks", "start") else 1
    return settings.timeout(op) + rounds * (settings.health_timeout_s + settings.start_timeout_s) + MARGIN_S


def summary(error: BaseException) -> str:
    """One line for a Ray error: its type and the last line of its (multi-line) message."""
    return f"{type(error).__name__}: {last_line(str(error))}"


class NodePool:
    """The Ray actor on one node: the node's `EnvironmentPool` and its open episodes, by episode id."""

    def __init__(self, factory: str, kwargs: dict, settings: PoolSettings, log_dir: str | None):
        self.pool = EnvironmentPool(factory, kwargs, settings, log_dir=log_dir)
        self.episodes = {}  # episode id -> its episode of the pool (a RemoteEpisode)

    def ready(self) -> str:
        """The id of the node the actor runs on, once it runs."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def tasks(self, split: str) -> list[Task]:
        return self.pool.tasks(split)

    def start(self, task: Task, seed: int) -> tuple[str, list[dict]]:
        episode = self.pool.start(task, seed)
        self.episodes[episode.episode_id] = episode
        return episode.episode_id, episode.messages()

    def step(self, episode_id: str, action_text: str):
        return self.episodes[episode_id].step(action_text)

    def verdict(self, episode_id: str):
        return self.episodes[episode_id].verdict()

    def close(self, episode_id: str) -> None:
        self.episodes.pop(episode_id).close()

    def stop(self) -> None:
        """Close the pool: its workers and their sandboxes are killed."""
        self.pool.close()


@dataclass(eq=False)
class Node:
    """One node of the cluster as the rollout side sees it: its actor and open episodes."""

    index: int
    node_id: str
    address: str
    actor: object
    workers: int
    open: int = 0
    lost: bool = False

    @property
    def name(self) -> str:
        return f"{self.address} ({self.node_id[:12]})"


class RayEnvironment:
    """An `Environment` whose episodes run on the nodes of a Ray cluster (see the module docstring)."""

    name: str  # ray:<factory>

    def __init__(
        self,
        factory: str,
        kwargs: dict,
        settings: PoolSettings,
        ray: RaySettings,
        log_dir: str | Path | None = None,
    ):
        """Cheap: the cluster is joined on first use, at `ray.address`. `settings` are each node's pool's, with
        `ray.workers_per_node` workers (null: `settings.workers`); `ray.nodes` caps the nodes used (null: every alive
        node with CPUs)."""
        self.factory, self.kwargs, self.address, self.node_cap = factory, kwargs, ray.address, ray.nodes
        self.settings = replace(settings, workers=ray.workers_per_node or settings.workers)
        self.log_dir = str(log_dir) if log_dir is not None else None
        self.name = f"ray:{factory}"
        self.ray = None  # the ray module, once joined
        self.connected = False  # whether this environment connected to the cluster (and so disconnects)
        self.nodes: list[Node] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an episode closed or a node was lost

    @property
    def max_concurrent_episodes(self) -> int:
        """The workers of the nodes that joined (a lost node's share included: `start` waits for a live one)."""
        return sum(node.workers for node in self._join())

    def _join(self) -> list[Node]:
        with self._lock:
            if not self.nodes:
                self.nodes = self._place_actors()
            return self.nodes

    def _place_actors(self) -> list[Node]:
        """Connect (unless Ray already is), then start one `NodePool` actor on each chosen node; the nodes whose
        actor did not start (its node died, or it could not be built there) are left out, with a warning."""
        ray = self.ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            try:
                ray.init(address=self.address)
            except ConnectionError as error:
                raise SystemicFaultError(
                    f"cannot join the Ray cluster at env.ray.address={self.address}: {last_line(str(error))}"
                ) from None
            self.connected = True
        alive = [info for info in ray.nodes() if info["Alive"] and info["Resources"].get("CPU", 0) > 0]
        alive = sorted(alive, key=lambda info: (info["NodeManagerAddress"], info["NodeID"]))[: self.node_cap]
        if not alive:
            raise SystemicFaultError(
                f"the Ray cluster at env.ray.address={self.address} has no alive node with CPUs: join environment "
                "nodes with `ray start --address=<head>:6379`"
            )
        actor_class = ray.remote(NodePool)
        nodes = []
        for info in alive:
            actor = actor_class.options(
                num_cpus=0,  # the pool's workers are processes of its own, not Ray tasks
                max_concurrency=self.settings.workers + 2,  # a call per open episode, and `tasks` or `stop`
                scheduling_strategy=NodeAffinitySchedulingStrategy(info["NodeID"], soft=False),
            ).remote(self.factory, self.kwargs, self.settings, self.log_dir)
            nodes.append(Node(0, info["NodeID"], info["NodeManagerAddress"], actor, self.settings.workers))
        readiness = [node.actor.ready.remote() for node in nodes]
        ray.wait(readiness, num_returns=len(readiness), timeout=self.settings.start_timeout_s + MARGIN_S)
        started, failed = [], []
        for node, ready in zip(nodes, readiness):
            try:
                ray.get(ready, timeout=0)
            except ray.exceptions.RayError as error:  # its creation failed, its node died, or it still waits
                failed.append(f"Ray node {node.name}: {summary(error)}")
                self._kill([node])
            else:
                started.append(replace(node, index=len(started)))  # workers are numbered over the serving nodes
        if not started:
            raise SystemicFaultError(f"the environment's actor started on no Ray node; {failed[0]}")
        if failed:
            warnings.warn(
                f"the environment runs without the Ray nodes where its actor did not start: {'; '.join(failed)}",
                RuntimeWarning,
                stacklevel=2,
            )
        return started

    def tasks(self, split: str) -> list[Task]:
        """The split's tasks, from the first live node that answers."""
        while True:
            node = self._take_node()
            try:
                return self.call(node, "tasks", split)
            except EnvironmentFault as fault:
                if fault.reason != "node_lost":
                    raise
            finally:
                self._hand_back(node)

    def start(self, task: Task, seed: int) -> RemoteEpisode:
        """The episode, on one node (its `host`) until `close()`: each call goes to that node's actor."""
        node = self._take_node()
        try:
            episode_id, messages = self.call(node, "start", task, seed)
        except BaseException:
            self._hand_back(node)
            raise
        return RemoteEpisode(episode_id, messages, node, self._request, self._end)

    def _request(self, node: Node, episode_id: str, op: str, *args):
        return self.call(node, op, episode_id, *args)

    def _end(self, node: Node, episode_id: str) -> None:
        """Close the episode on its node, then free its place there; a lost node has nothing left to close."""
        try:
            self.call(node, "close", episode_id)
        except EnvironmentFault as fault:
            if fault.reason != "node_lost":
                raise
        finally:
            self._hand_back(node)

    def _take_node(self) -> Node:
        """The live node with the fewest open episodes, once it has a free worker (counted as taken)."""
        nodes = self._join()
        with self._changed:
            while True:
                live = [node for node in nodes if not node.lost]
                if not live:
                    raise SystemicFaultError(
                        f"every Ray node of the environment was lost ({', '.join(n.name for n in nodes)}): check "
                        "the environment nodes (`ray status`) and their logs"
                    )
                node = min(live, key=lambda n: n.open)
                if node.open < node.workers:
                    node.open += 1
                    return node
                self._changed.wait()

    def _hand_back(self, node: Node) -> None:
        with self._changed:
            node.open -= 1
            self._changed.notify_all()

    def call(self, node: Node, op: str, *args):
        """`op` on `node`'s actor: a fault raised there is raised here as itself; a lost node (its actor died or
        did not answer in time) as `EnvironmentFault("node_lost")`."""
        ray = self.ray
        if node.lost:
            raise EnvironmentFault("node_lost", f"Ray node {node.name} was lost earlier")
        try:
            return ray.get(getattr(node.actor, op).remote(*args), timeout=call_timeout(self.settings, op))
        except ray.exceptions.RayTaskError as error:
            raise self._from_node(node, error) from None
        except ray.exceptions.RayError as error:  # Ray could not run or answer it: the actor died (RayActorError),
            # its node died, it did not answer in time (GetTimeoutError), or its reply was lost with the node
            self._lose(node)
            raise EnvironmentFault(
                "node_lost", f"Ray node {node.name} was lost during {op}: {summary(error)}"
            ) from None

    def _from_node(self, node: Node, error) -> BaseException:
        """What a call raised on `node` (Ray's `RayTaskError` wraps it as `cause`), as the caller should see it."""
        cause = error.cause
        if isinstance(cause, EnvironmentFault):
            worker = None if cause.worker is None else node.index * self.settings.workers + cause.worker
            return EnvironmentFault(cause.reason, f"on Ray node {node.name}: {cause.detail}", worker=worker)
        if isinstance(cause, SystemicFaultError):
            return SystemicFaultError(f"on Ray node {node.name}: {cause}")
        if isinstance(cause, AgentFailure):
            return cause
        return error  # a bug: Ray's error, with the node's traceback

    def _lose(self, node: Node) -> None:
        """Take the node out of service: no new episodes, and its actor is killed in case it still runs."""
        with self._changed:
            node.lost = True
            self._changed.notify_all()  # waiting episodes pick another node, or learn that none is left
        self._kill([node])

    def _kill(self, nodes: list[Node]) -> None:
        for node in nodes:
            self.ray.kill(node.actor, no_restart=True)

    def close(self) -> None:
        """Close every live node's pool, kill the actors, and disconnect if this environment connected."""
        with self._lock:
            nodes, self.nodes = self.nodes, []
        if not nodes:
            return
        stopping = [node.actor.stop.remote() for node in nodes if not node.lost]
        if stopping:
            self.ray.wait(stopping, num_returns=len(stopping), timeout=MARGIN_S)
        self._kill(nodes)
        if self.connected:
            self.ray.shutdown()
            self.connected = False
