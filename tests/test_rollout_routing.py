"""Per-episode rollouts over several SGLang servers (fakes with long-tailed latencies): sticky routing, a server that
dies mid-run ejected then re-admitted, no episode lost, quarantine counted; and the local engine's gathered batches
reproducing the turn-synchronous ones."""

import random
import threading
import time

import pytest
from fake_sglang import FakeGateway, FakeSGLang

from canopy.envs.base import Task, Verdict
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.tiny_model import build_byte_tokenizer
from tests.helpers import UNFILTERED, CountdownEnvironment, sglang_engine_for, tiny_weights
from tests.scripted import RecordingEngine

BUDGET = Budget(max_turns=20, max_response_tokens=400, max_prompt_tokens=128, max_observation_tokens=16,
                max_context_tokens=2048)  # fmt: skip


def jobs(count: int, turns: int) -> list[tuple[Task, int]]:
    return [(Task(f"e{i}", 1, "s", {"turns": turns}), 0) for i in range(count)]


def episode_servers(servers: list[FakeSGLang], tokenizer) -> dict[str, set[int]]:
    """Episode id (from its prompt) -> the servers that served its turns."""
    seen: dict[str, set[int]] = {}
    for number, server in enumerate(servers):
        for body in server.bodies("/generate"):
            episode = tokenizer.decode(body["input_ids"]).split("episode ")[1].split("<")[0]
            seen.setdefault(episode, set()).add(number)
    return seen


@pytest.fixture
def servers():
    made = []
    rng = random.Random(0)
    for _ in range(3):  # long-tailed per-request latencies
        made.append(FakeSGLang(delay=lambda body: min(0.2, rng.lognormvariate(-5.0, 1.0))))
    yield made
    for server in made:
        server.stop()


def test_every_turn_of_an_episode_goes_to_one_server(tiny_path, tokenizer, tmp_path, servers):
    tokenizer = build_byte_tokenizer()  # the prompt names its episode exactly
    engine = sglang_engine_for(tiny_path, tmp_path, servers, concurrency=64)
    trajectories, _ = run_episodes(
        engine,
        CountdownEnvironment(),
        tokenizer,
        jobs(24, 5),
        BUDGET,
        UNFILTERED,
    )
    assert all(t.verdict == Verdict(1, 1) and t.num_turns == 5 for t in trajectories)
    assert all(len(numbers) == 1 for numbers in episode_servers(servers, tokenizer).values())
    assert engine.router.counts["turns"] == 24 * 5 and engine.router.counts["on_first_server"] == 24 * 5
    load = [len(s.bodies("/generate")) for s in servers]
    assert min(load) > 0  # first turns spread over the servers (least loaded)


def test_a_dying_server_is_ejected_then_readmitted_and_no_episode_is_lost(tiny_path, tokenizer, tmp_path, servers):
    engine = sglang_engine_for(tiny_path, tmp_path, servers, concurrency=64, max_retries=2)
    engine.router.health_interval_s = 0.05
    victim = servers[0]
    port = int(victim.url.rsplit(":", 1)[1])

    def kill_then_revive():
        while len(victim.bodies("/generate")) < 10:
            time.sleep(0.005)
        victim.stop()
        while engine.router.counts["ejections"] == 0:
            time.sleep(0.005)
        restarted = FakeSGLang(port=port)  # back, but with other weights: it stays out until it has ours
        time.sleep(0.3)
        readmitted_while_stale.append(engine.router.counts["readmissions"])
        restarted.version = "0"  # re-synced
        servers[0] = restarted

    readmitted_while_stale = []
    saboteur = threading.Thread(target=kill_then_revive)
    saboteur.start()
    env = CountdownEnvironment(step_s=0.01)
    trajectories, _ = run_episodes(engine, env, tokenizer, jobs(24, 8), BUDGET, UNFILTERED)
    saboteur.join()
    assert readmitted_while_stale == [0]  # healthy but on other weights: not re-admitted
    assert len(trajectories) == 24 and all(t.verdict == Verdict(1, 1) for t in trajectories)  # none lost
    assert engine.router.counts["ejections"] == 1
    deadline = time.monotonic() + 5
    while engine.router.counts["readmissions"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.router.counts["readmissions"] == 1 and not any(s.ejected for s in engine.fleet.servers)
    moved = engine.router.counts["turns"] - engine.router.counts["on_first_server"]
    assert moved > 0  # the dead server's episodes moved (and stayed) elsewhere
    engine.close()


def test_a_server_on_other_weights_is_ejected_and_its_samples_are_drawn_again(tiny_path, tokenizer, tmp_path, servers):
    """A server restarted at its old address (base weights) while requests were on their way to it: each sample it
    returns is discarded and drawn again on a server with the engine's weights (this test's dying-server sibling
    once failed on exactly this race, with StaleSampleError)."""
    engine = sglang_engine_for(tiny_path, tmp_path, servers, concurrency=64)
    engine.router.health_interval_s = 0.05
    servers[0].version = "default"  # as a restarted server reports, until re-synced
    env = CountdownEnvironment()
    trajectories, _ = run_episodes(engine, env, tokenizer, jobs(12, 3), BUDGET, UNFILTERED)
    assert len(trajectories) == 12 and all(t.verdict == Verdict(1, 1) for t in trajectories)
    assert len(servers[0].bodies("/generate")) >= 1 and engine.router.counts["ejections"] == 1
    assert engine.router.counts["readmissions"] == 0  # it never serves our weights, so it stays out
    engine.close()


def test_requests_failing_everywhere_quarantine_their_episodes_and_are_counted(tiny_path, tokenizer, tmp_path):
    server = FakeSGLang()
    engine = sglang_engine_for(tiny_path, tmp_path, [server], max_retries=1)
    server.stop()
    trajectories, _ = run_episodes(
        engine,
        CountdownEnvironment(),
        tokenizer,
        jobs(3, 2),
        BUDGET,
        UNFILTERED,
    )
    assert [t.quarantine for t in trajectories] == ["engine_request_failed"] * 3
    assert engine.router.counts["ejections"] == 1
    engine.close()


def test_an_in_process_environment_gathers_every_live_episode_per_batch_in_job_order():
    """The turn-synchronous batches of the old loop, hence the same samples for a seeded local engine."""
    tokenizer = build_byte_tokenizer()
    engine = RecordingEngine(tokenizer)
    env = CountdownEnvironment()
    env.max_concurrent_episodes = None  # in-process
    work = [(Task(f"e{i}", 1, "s", {"turns": turns}), 0) for i, turns in enumerate([3, 1, 2, 3])]
    trajectories, _ = run_episodes(engine, env, tokenizer, work, BUDGET, UNFILTERED)
    assert engine.batches == [["e0", "e1", "e2", "e3"], ["e0", "e2", "e3"], ["e0", "e3"]]
    assert [t.num_turns for t in trajectories] == [3, 1, 2, 3]
    engine.batches.clear()  # at most 2 at once: a finished episode's place goes to the next job
    trajectories, _ = run_episodes(engine, env, tokenizer, work, BUDGET, UNFILTERED, concurrency=2)
    assert engine.batches == [["e0", "e1"], ["e0", "e2"], ["e0", "e2"], ["e3"], ["e3"], ["e3"]]


def test_a_gateway_carries_the_data_plane_keyed_by_episode(tiny_path, tmp_path, servers):
    """`engine.sglang.router_url`: every /generate goes to SGLang's model gateway with the episode as its routing key
    (so the gateway keeps each episode on one server); weight sync and version checks still reach each server."""
    tokenizer = build_byte_tokenizer()
    gateway = FakeGateway(servers)
    try:
        engine = sglang_engine_for(tiny_path, tmp_path, servers, router_url=gateway.url)
        trajectories, _ = run_episodes(
            engine,
            CountdownEnvironment(),
            tokenizer,
            jobs(12, 4),
            BUDGET,
            UNFILTERED,
            concurrency=12,
        )
        placement = episode_servers(servers, tokenizer)
        engine.update_weights(tiny_weights(tiny_path, 0.01).items(), 1)
        after_sync = engine.generate([[5, 6]], [4], UNFILTERED, keys=["late"])[0]
    finally:
        gateway.stop()
    assert all(t.quarantine is None and t.num_turns == 4 for t in trajectories)
    keys = [key for _, key, _ in gateway.calls]
    assert len(keys) == 12 * 4 + 1 and all(path == "/generate" for path, _, _ in gateway.calls)
    turns = {key: keys.count(key) for key in set(keys) - {"late"}}
    assert len(turns) == 12 and set(turns.values()) == {4}  # one key per episode, on each of its turns
    assert len(placement) == 12 and {len(s) for s in placement.values()} == {1}  # each episode on one server
    assert sum(len(server.bodies("/generate")) for server in servers) == len(keys)  # all through the gateway
    for server in servers:  # the control plane: every server, directly
        assert server.bodies("/update_weights_from_disk")[-1]["weight_version"] == "1" and server.version == "1"
    assert after_sync.weight_version == 1 and engine.router.counts["turns"] == len(keys)


def test_a_server_stopped_on_purpose_is_never_revived(tmp_path):
    """A relaunch (or close) stops the launched servers; a health check that began before it, and sees one of them
    dead, must not launch it again on its port beside its replacement (which made a budget transfer launch 4 servers
    for 3 under load)."""
    import sys
    from types import SimpleNamespace

    from canopy.rollout.http.fleet import Fleet

    launched = []

    class Sleeper:  # a backend whose "server" is a sleeping process
        name, key, ready_path = "sleeper", "engine.sleeper", "/ready"

        def launch_command(self, index, context_length, rope_scaling, seed):
            launched.append(index)
            return [sys.executable, "-c", "import time; time.sleep(60)"], {}

    settings = SimpleNamespace(python=sys.executable, base_port=0, host="127.0.0.1", startup_timeout_s=0.1)
    fleet = Fleet(settings, Sleeper(), tmp_path)
    fleet.launch_settings = (None, None, 0)
    server = fleet._launch(0)
    fleet.servers = [server]
    fleet.stop()
    assert server.process.poll() is not None  # dead, as a health check would find it
    assert not fleet.revive(server) and launched == [0]
    server.stopped = False  # the same dead process, had it died on its own: launched again
    assert not fleet.revive(server)  # (it cannot become ready here: no server answers)
    assert launched == [0, 0]
    fleet.stop()
