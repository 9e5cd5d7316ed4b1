"""The environment protocol (`canopy/envs/base.py`): every environment and episode of Canopy, its serving layer and
the tests' fakes declares each member of `Environment` and `Episode` with the protocol's signature, so Canopy reads
them without probing; one behaviour test per capability; and the serving layer's modules import without a cycle."""

import inspect
import sys
from pathlib import Path

import grimp
import pytest

from canopy.envs import built_in_environments
from canopy.envs.appworld import AppWorldEnvironment, AppWorldEpisode
from canopy.envs.base import Environment, Episode
from canopy.envs.embedded import EmbeddedEnvironment, VaultEpisode
from canopy.envs.fault_injection import FaultInjectingEnvironment, InjectedEpisode
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.envs.python_tasks import PythonTaskEnvironment, PythonTaskEpisode
from canopy.envs.ray_pool import RayEnvironment, RaySettings
from canopy.envs.remote import RemoteEpisode
from canopy.envs.rgym import RGymEnvironment, RGymEpisode
from canopy.envs.swe_fault_injection import FaultInjectingSWEEnvironment, InjectedSWEEpisode
from canopy.envs.swebench import SWEBenchEnvironment, SWEBenchEpisode
from canopy.errors import ConfigError
from canopy.protocols import mismatches, protocol_members
from tests.faulty_envs import FailingEnvironment, GatedEnvironment

ROOT = Path(__file__).resolve().parents[1]


def letters() -> dict:
    """The worked example's module (`tests/helpers.py`, docs/environments.md), executed."""
    from tests.helpers import LETTERS_ENV

    namespace: dict = {}
    exec(LETTERS_ENV, namespace)
    return namespace


class Partial:
    """An environment of before the protocol declared its capabilities, with a start that lost its seed."""

    name = "partial"

    def tasks(self, split):
        return []

    def start(self, task):
        return None


ENVIRONMENTS = [
    EmbeddedEnvironment,
    PythonTaskEnvironment,
    FaultInjectingEnvironment,
    AppWorldEnvironment,
    SWEBenchEnvironment,
    FaultInjectingSWEEnvironment,
    RGymEnvironment,
    EnvironmentPool,
    RayEnvironment,
    GatedEnvironment,
    FailingEnvironment,
]
EPISODES = [
    VaultEpisode,
    PythonTaskEpisode,
    InjectedEpisode,
    AppWorldEpisode,
    SWEBenchEpisode,
    InjectedSWEEpisode,
    RGymEpisode,
    RemoteEpisode,
]


def test_the_protocols_members_are_read_from_its_annotations_and_methods():
    assert protocol_members(Environment).keys() == {"name", "max_concurrent_episodes", "tasks", "start", "close"}
    assert protocol_members(Episode).keys() == {"messages", "step", "verdict", "close"}
    assert str(protocol_members(Environment)["start"]) == "(self, task: canopy.envs.base.Task, seed: int) -> " + (
        "canopy.envs.base.Episode"
    )
    assert mismatches(Partial, Environment) == [
        "Partial.max_concurrent_episodes is not declared",
        "Partial.start(self, task) is not start(self, task: canopy.envs.base.Task, seed: int) -> "
        "canopy.envs.base.Episode",
        "Partial.close() is not a method",
    ]


def test_every_built_in_environment_is_checked():
    assert {module.ENVIRONMENT for module in built_in_environments().values()} <= set(ENVIRONMENTS)


@pytest.mark.parametrize("environment", ENVIRONMENTS + ["letters"], ids=lambda e: getattr(e, "__name__", e))
def test_each_environment_declares_every_member_of_the_protocol(environment):
    cls = letters()["LettersEnvironment"] if environment == "letters" else environment
    assert mismatches(cls, Environment) == []


@pytest.mark.parametrize("episode", EPISODES + ["letters"], ids=lambda e: getattr(e, "__name__", e))
def test_each_episode_declares_every_member_of_the_protocol(episode):
    cls = letters()["LettersEpisode"] if episode == "letters" else episode
    assert mismatches(cls, Episode) == []


def test_the_instances_carry_what_their_classes_declare(tmp_path):
    """The data members as an instance has them (`getattr_static`: a property is not run, so Ray is not joined)."""
    gate = tmp_path / "gate"
    gate.touch()
    instances = [
        EmbeddedEnvironment(),
        FailingEnvironment(),
        GatedEnvironment(str(gate)),
        letters()["LettersEnvironment"](),
        EnvironmentPool("canopy.envs.embedded:EmbeddedEnvironment", {}, PoolSettings(workers=3)),  # starts nothing
        RayEnvironment(
            "canopy.envs.embedded:EmbeddedEnvironment", {}, PoolSettings(workers=2), RaySettings(address="auto")
        ),
    ]
    for instance in instances:
        for name in ("name", "max_concurrent_episodes"):
            inspect.getattr_static(instance, name)  # raises AttributeError when missing
    assert [instance.max_concurrent_episodes for instance in instances[:5]] == [None, None, None, None, 3]
    assert isinstance(inspect.getattr_static(instances[5], "max_concurrent_episodes"), property)


def test_in_process_environments_declare_no_cap():
    """None keeps an in-process environment's episodes in the loop's own thread (`run_episodes`); a pool declares
    its workers (above), a Ray environment the workers of its nodes (`tests/test_ray_pool.py`)."""
    for cls in ENVIRONMENTS:
        if cls not in (EnvironmentPool, RayEnvironment):
            assert inspect.getattr_static(cls, "max_concurrent_episodes") is None, cls


def test_closing_an_in_process_environment_leaves_it_usable():
    env = EmbeddedEnvironment()
    env.close()
    episode = env.start(env.tasks("train")[0], seed=0)
    assert episode.step("login").observation
    episode.close()
    env.close()


def test_closing_appworld_stops_its_server_and_grader_until_the_next_episode():
    """`AppWorldEnvironment.close()` without AppWorld: the server and grader it holds are stopped, once."""

    class Process:
        def __init__(self):
            self.stopped = 0

        def stop(self):
            self.stopped += 1

    env = AppWorldEnvironment.__new__(AppWorldEnvironment)  # its __init__ needs AppWorld's venv
    server, grader = Process(), Process()
    env.live, env.judge = server, grader
    env.close()
    env.close()
    assert (server.stopped, grader.stopped, env.live, env.judge) == (1, 1, None, None)


def test_the_data_module_closes_the_environment_at_teardown():
    """Every environment is closed at teardown: an in-process one too (it used to be probed for `close`)."""
    from canopy.rollout.budget import Budget
    from tests.helpers import datamodule_over

    class Counted(EmbeddedEnvironment):
        closed = 0

        def close(self):
            self.closed += 1

    env = Counted()
    budget = Budget(max_turns=1, max_response_tokens=8, max_prompt_tokens=64, max_observation_tokens=8,
                    max_context_tokens=128)  # fmt: skip
    datamodule = datamodule_over(env, lambda: None, None, tasks_per_step=1, group_size=2, budget=budget)
    datamodule.teardown("fit")
    assert env.closed == 1


def test_a_remote_episode_sends_its_calls_to_its_host_and_ends_there_once():
    calls, ended = [], []
    episode = RemoteEpisode(
        "t#0", [{"role": "user", "content": "hi"}], "host", lambda *call: calls.append(call) or len(calls),
        lambda host, episode_id: ended.append((host, episode_id)),
    )  # fmt: skip
    assert episode.messages() == [{"role": "user", "content": "hi"}]
    assert (episode.step("ls"), episode.verdict()) == (1, 2)
    assert calls == [("host", "t#0", "step", "ls"), ("host", "t#0", "verdict")]
    episode.close()
    episode.close()
    assert ended == [("host", "t#0")] and episode.host is None
    with pytest.raises(RuntimeError, match=r"^episode t#0 is closed$"):
        episode.step("ls")


def test_the_environment_modules_import_without_a_cycle():
    """Function-level imports included (grimp reads every import statement): the serving layer points one way,
    `serving` > `ray_pool` > `pool` > `remote`, `scratch`."""
    graph = grimp.build_graph("canopy", cache_dir=None)
    assert "canopy.envs.serving" in graph.modules  # this tree's canopy
    modules = {m for m in graph.modules if m == "canopy.envs" or m.startswith("canopy.envs.")}
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module) & modules:
            assert not graph.chain_exists(imported, module), f"{module} <-> {imported}"


def test_an_environment_of_before_the_protocol_is_refused_when_loaded_naming_what_to_add(tmp_path, monkeypatch):
    """A user's environment that lacks a member is refused at start, in one line naming each missing member and the
    fix, not at its first rollout or teardown with an AttributeError."""
    from canopy.envs import environment_module

    (tmp_path / "oldpkg").mkdir()
    (tmp_path / "oldpkg" / "__init__.py").write_text("")
    (tmp_path / "oldpkg" / "oldenv.py").write_text(
        "class Old:\n    name = 'old'\n\n    def tasks(self, split):\n        return []\n\n"
        "    def start(self, task, seed):\n        return None\n\n\nENVIRONMENT = Old\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "oldpkg.oldenv", raising=False)
    with pytest.raises(ConfigError) as error:
        environment_module("oldpkg.oldenv")
    assert str(error.value) == (
        "env.name=oldpkg.oldenv: oldpkg.oldenv.Old does not implement the Environment protocol (canopy/envs/base.py): "
        "Old.max_concurrent_episodes is not declared; Old.close() is not a method; an in-process environment "
        "declares `max_concurrent_episodes = None` and `def close(self): pass` (docs/environments.md)"
    )
