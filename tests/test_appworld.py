"""The AppWorld environment against the real package (`make appworld`), on synthetic tasks in AppWorld's own
on-disk format (scripts/appworld_synthetic_data.py), through the real pool and agent loop (Appendix G)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from canopy.envs.appworld import AppWorldEnvironment
from canopy.envs.base import AgentFailure, EnvironmentFault, SystemicFaultError, Verdict
from canopy.envs.pool import EnvironmentPool
from canopy.eval.metrics import summarize
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.engine import Generation
from canopy.tiny_model import build_byte_tokenizer
from tests.helpers import (
    APPWORLD_PYTHON,
    APPWORLD_SETTINGS,
    APPWORLD_SYNTHETIC_DATA,
    ROOT,
    UNFILTERED,
    code,
    logged_episodes,
)
from tests.scripted import FakeEngine

pytestmark = pytest.mark.skipif(not APPWORLD_PYTHON.is_file(), reason="AppWorld's venv is missing: run `make appworld`")
BUDGET = Budget(
    max_turns=3, max_response_tokens=4096, max_prompt_tokens=8192, max_observation_tokens=2048, max_context_tokens=32768
)


@pytest.fixture(scope="module")
def env_kwargs(tmp_path_factory):
    root = tmp_path_factory.mktemp("appworld") / "root"
    subprocess.run([str(APPWORLD_PYTHON), str(APPWORLD_SYNTHETIC_DATA), str(root)], check=True)
    return {
        "python": str(APPWORLD_PYTHON),
        "root": str(root),
        "cell_timeout_s": 2,
        "request_timeout_s": 30,
        "start_timeout_s": 60,
    }


@pytest.fixture(scope="module")
def pool(env_kwargs):
    pool = EnvironmentPool("canopy.envs.appworld:AppWorldEnvironment", env_kwargs, APPWORLD_SETTINGS)
    yield pool
    pool.close()


class ScriptEngine(FakeEngine):
    """Replies by task (found by its instruction in the prompt) and by the episode's own turn."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.im_start, self.im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        out = []
        for prompt, limit in zip(prompts, max_new_tokens):
            text = self.tokenizer.decode(prompt)
            replies = next(replies for instruction, replies in self.scripts.items() if instruction in text)
            turn = (prompt.count(self.im_start) - 3) // 2  # system, user, assistant; then user + assistant per turn
            ids = self.tokenizer.encode(replies[min(turn, len(replies) - 1)], add_special_tokens=False) + [self.im_end]
            out.append(Generation(ids[:limit], [-0.5] * min(len(ids), limit), "stop", 0))
        return out


def server_pid(worker_pid: int) -> int:
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return next(int(pid) for pid in children if b"uvicorn" in Path(f"/proc/{pid}/cmdline").read_bytes())


def test_tasks_carry_splits_tiers_and_scenarios(env_kwargs):
    env = AppWorldEnvironment(**env_kwargs)
    train = env.tasks("train")
    assert [t.task_id for t in train[:3]] == ["a1a1a1a_1", "a1a1a1a_2", "a1a1a1a_3"]
    assert {t.tier for t in train} == {1, 2} and {t.scenario for t in train} == {"a1a1a1a", "b2b2b2b"}
    assert [(t.task_id, t.tier) for t in env.tasks("test_challenge")] == [("e5e5e5e_1", 2)]
    assert env.tasks("dev")[0].tier == 3 and len(env.tasks("test_normal")) == 1
    with pytest.raises(ValueError, match="test_challenge"):
        env.tasks("test")


@pytest.fixture(scope="module")
def scripted(pool):
    """The six training tasks, each answered by a script: look at the API docs, then complete the task (one answer
    wrong). Returns (tokenizer, tasks, trajectories)."""
    tokenizer = build_byte_tokenizer()
    tasks = pool.tasks("train")
    answers = {
        "17 plus 25?": "42",
        "3 plus 4?": "8",
        "10 plus 90?": "100",
        "my phone number?": "'5550100123'",
        "my email address?": "'ada.park@example.com'",
        "my last name?": "'Park'",
    }
    scripts = {
        f"Task: What is {key}": [
            code("print(apis.api_docs.show_app_descriptions())"),
            code(f"apis.supervisor.complete_task(answer={answer})"),
        ]
        for key, answer in answers.items()
    }
    trajectories, _ = run_episodes(
        ScriptEngine(tokenizer, scripts),
        pool,
        tokenizer,
        [(t, 0) for t in tasks],
        BUDGET,
        UNFILTERED,
    )
    return tokenizer, tasks, trajectories


def test_scripted_episodes_pass_fail_and_score_tgc_sgc(scripted):
    """Correct answers pass AppWorld's own tests; a wrong one passes 1 of 2 (dense 0.5, sparse 0)."""
    tokenizer, tasks, trajectories = scripted
    prompt = tokenizer.decode(trajectories[0].token_ids[: trajectories[0].prompt_length])
    assert "I am your supervisor" in prompt and "My name is: Ada Park" in prompt and "What is 17 plus 25?" in prompt
    assert "- spotify: A music streaming app" in prompt and "show_api_doc(app_name=" in prompt
    observation = tokenizer.decode(trajectories[0].token_ids[trajectories[0].prompt_length :])
    assert "An app to search and explore API documentation." in observation  # the real api_docs app answered
    assert [t.ending for t in trajectories] == ["done"] * 6 and [t.num_turns for t in trajectories] == [2] * 6
    assert [t.verdict for t in trajectories] == [Verdict(2, 2), Verdict(1, 2)] + [Verdict(2, 2)] * 4
    assert trajectories[1].reward("sparse") == 0.0 and trajectories[1].reward("dense") == 0.5
    runs = {t.task.task_id: [t.reward("sparse")] for t in trajectories}
    summary = summarize(tasks, runs)  # TGC = mean success; SGC = mean over scenarios of the min (AppWorld's Metric)
    assert summary["all"]["tgc_mean"] == 5 / 6 and summary["all"]["sgc_mean"] == 0.5
    assert (summary["tier1"]["tgc_mean"], summary["tier1"]["sgc_mean"]) == (2 / 3, 0.0)
    assert (summary["tier2"]["tgc_mean"], summary["tier2"]["sgc_mean"]) == (1.0, 1.0)


@pytest.mark.slow
def test_appworld_episodes_are_logged_and_shown_in_the_viewer(scripted, tmp_path):
    """The trajectory log and the rollout viewer on AppWorld: the policy's code and the real app's answer, turn by
    turn in a headless Chromium; the wrong answer's episode with its partial verdict and zero reward."""
    from canopy.reports.viewer import build_viewer
    from canopy.trajectories import TrajectoryLog, read_step
    from tests.helpers import dom, element

    tokenizer, tasks, trajectories = scripted
    log = TrajectoryLog(tmp_path / "trajectories", tokenizer, "m", logged_episodes(), "sparse")
    log.log_step("eval_appworld", 0, [[t] for t in trajectories])
    log.close()
    records = read_step(tmp_path / "trajectories" / "eval_appworld" / "step_000000.jsonl.gz")
    wrong = next(r for r in records if r["task_id"] == trajectories[1].task.task_id)
    verdict = wrong["verdict"]
    assert (verdict["passed"], verdict["total"], verdict["success"], wrong["reward"]) == (1, 2, False, 0.0)
    assert wrong["turns"][1]["action"].startswith(code("apis.supervisor.complete_task(answer=8)"))
    assert "An app to search and explore API documentation." in wrong["turns"][0]["observation"]

    shown = element(dom(build_viewer(tmp_path), f"stream=eval_appworld&step=0&task={wrong['task_id']}"), "episode-view")
    assert f"<td>{wrong['task_id']}</td>" in shown and "<td>0.000</td>" in shown
    assert "apis.supervisor.complete_task(answer=8)" in shown and "explore API documentation" in shown
    assert shown.count('class="turn action"') == 2


def test_infinite_loop_is_an_error_observation_and_scores_zero(pool):
    """AppWorld's per-cell timeout stops the loop and reports it; the episode ends at the turn limit unscored."""
    tokenizer = build_byte_tokenizer()
    task = pool.tasks("train")[0]
    engine = ScriptEngine(tokenizer, {"Task: What is 17 plus 25?": [code("while True:\n    pass")]})
    [trajectory], _ = run_episodes(engine, pool, tokenizer, [(task, 0)], BUDGET, UNFILTERED)
    assert "Execution timed out after 2 seconds" in tokenizer.decode(trajectory.token_ids[trajectory.prompt_length :])
    assert trajectory.ending == "turn_limit" and trajectory.quarantine is None
    assert trajectory.verdict == Verdict(0, 2) and trajectory.reward("sparse") == 0.0


def test_code_that_fails_before_any_api_call_is_an_invalid_action(pool):
    """Format health, through the pool: a reply without a code block, code that does not parse, and code that fails
    before its first API call (the world's API-call log did not grow) are invalid actions; code that runs, or fails
    after calling an API, is valid."""
    episode = pool.start(pool.tasks("train")[0], seed=0)
    replies = [
        ("no code block, just prose", False),
        (code("x = (1,"), False),  # does not parse
        (code("1 / 0"), False),  # raises before any API call, with no call logged yet
        (code("x = 1"), True),
        (code("print(apis.api_docs.show_app_descriptions())"), True),
        (code("apis.api_docs.show_app_descriptions()\n1 / 0"), True),  # raises after a call
        (code("y = undefined_name"), False),  # raises before any call, with calls logged before
    ]
    assert [episode.step(reply).valid for reply, _ in replies] == [valid for _, valid in replies]
    episode.close()


def test_code_that_outlives_the_cell_timeout_is_an_agent_failure(pool):
    """A loop that swallows AppWorld's timeout exception hangs the server: still the agent's doing (scored 0);
    its server is replaced, its worker stays."""
    episode = pool.start(pool.tasks("train")[0], seed=0)
    worker, old_server = episode.host.pid, server_pid(episode.host.pid)
    with pytest.raises(AgentFailure) as failure:
        episode.step(
            code("while True:\n    try:\n        while True:\n            pass\n    except Exception:\n        pass")
        )
    assert failure.value.reason == "agent_timeout"
    episode.close()
    assert worker in pool.worker_pids()
    with pytest.raises(ProcessLookupError):
        os.kill(old_server, 0)  # its server was replaced


def test_server_killed_mid_episode_is_quarantined(pool):
    """kill -9 from outside between two steps: the server's own code cannot send SIGKILL (seccomp), so the death
    is the serving layer's, and the fault says why."""
    tasks = pool.tasks("train")
    episode = pool.start(tasks[0], seed=0)
    assert not episode.step(code("x = 1")).done
    os.kill(server_pid(episode.host.pid), signal.SIGKILL)
    with pytest.raises(EnvironmentFault) as fault:
        episode.step(code("print(x)"))
    assert fault.value.reason == "appworld_server_killed" and "cannot send (seccomp)" in fault.value.detail
    episode.close()
    episode = pool.start(tasks[0], seed=0)  # the pool goes on with fresh servers
    assert episode.step(code("apis.supervisor.complete_task(answer=42)")).done
    assert episode.verdict() == Verdict(2, 2)
    episode.close()


def test_an_episode_whose_world_was_replaced_is_corrupted(env_kwargs):
    env = AppWorldEnvironment(**env_kwargs)
    first = env.start(env.tasks("train")[0], seed=0)
    second = env.start(env.tasks("train")[1], seed=0)  # the same server now holds another world
    try:
        with pytest.raises(EnvironmentFault) as fault:
            first.step(code("print(1)"))
        assert fault.value.reason == "cross_episode_corruption"
        assert second.step(code("print(1)")).observation == "1\n"
    finally:
        second.close()
        env.discard_server()


@pytest.mark.parametrize(
    "override,message",
    [
        ("env.appworld.python=/no/python", "run `make appworld`"),
        ("env.pool.workers=0", "env.pool.workers"),
        ("env.appworld.root=/no/root", "appworld download data"),
        ("env.pool.request_timeout_s=100", "must exceed 180"),
    ],
)
def test_appworld_config_names_the_fix(env_kwargs, tiny_path, override, message):
    """What the entry points check before anything starts: `validate`, then the environment's own keys as it is
    built (a pool starts no worker until its first episode)."""
    from canopy.build import build_env
    from canopy.config import validate
    from canopy.errors import ConfigError
    from tests.helpers import config

    def checked(cfg):
        validate(cfg)
        build_env(cfg)

    cfg = config(
        "experiment=appworld_canopy",
        f"model.path={tiny_path}",
        f"env.appworld.root={env_kwargs['root']}",
        "env.appworld.cell_timeout_s=100",
        "env.appworld.request_timeout_s=60",
        "engine.sglang.python=/x",
        override,
    )
    with pytest.raises(ConfigError, match=message):
        checked(cfg)
    checked(
        config(
            "experiment=appworld_canopy",
            f"model.path={tiny_path}",
            f"env.appworld.root={env_kwargs['root']}",
            "engine.sglang.python=/x",
        )
    )


def test_policy_code_in_the_server_has_no_network_and_writes_only_in_its_folder(pool, tmp_path):
    """The AppWorld server runs the policy's code, so it runs confined (canopy.envs.sandbox.confined)."""
    outside = tmp_path / "outside.txt"
    episode = pool.start(pool.tasks("train")[0], seed=0)
    probe = (
        f"try:\n    open({str(outside)!r}, 'w').write('x')\n    print('WROTE')\nexcept Exception as error:\n    "
        "print('write blocked', error)\n"
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n    print('CONNECTED')\n"
        "except Exception as error:\n    print('network blocked', error)"
    )
    observation = episode.step(code(probe)).observation
    server = server_pid(episode.host.pid)
    assert os.readlink(f"/proc/{server}/ns/net") != os.readlink("/proc/self/ns/net")  # a network namespace of its own
    episode.close()
    assert "WROTE" not in observation and "CONNECTED" not in observation, observation
    assert not outside.exists()


def test_servers_never_write_to_the_users_home(env_kwargs, monkeypatch, tmp_path):
    """A fresh machine's empty home: AppWorld's IPython creates its folder in the server's private home, and
    the user's home stays empty (the confined server cannot write there: every /initialize once answered 500)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for variable in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "IPYTHONDIR", "APPWORLD_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    scratch = Path(tempfile.mkdtemp(prefix="canopy-home-"))  # short: a server's socket path lies below it
    pool = EnvironmentPool(
        "canopy.envs.appworld:AppWorldEnvironment", env_kwargs, APPWORLD_SETTINGS, scratch_root=scratch
    )
    try:
        episode = pool.start(pool.tasks("train")[0], seed=0)
        observation = episode.step(code("import os\nprint('home is', os.path.expanduser('~'))")).observation
        private = list(scratch.glob("w*/appworld-*/home"))
        assert len(private) == 1 and (private[0] / ".ipython").is_dir()
        assert f"home is {private[0]}" in observation
        assert episode.verdict().total == 2
        episode.close()
    finally:
        pool.close()
    assert list(home.iterdir()) == []


def test_a_scratch_root_too_long_for_the_servers_sockets_stops_the_pool_at_start(env_kwargs, tmp_path):
    """Unix socket paths hold 107 bytes: a scratch root that leaves no room for a server's socket is a broken
    setup, named with its fix when the workers start, not a fault quarantined episode after episode."""
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    pool = EnvironmentPool("canopy.envs.appworld:AppWorldEnvironment", env_kwargs, APPWORLD_SETTINGS, scratch_root=deep)
    try:
        with pytest.raises(SystemicFaultError, match="over the 107 a unix socket path may have: give the environment"):
            pool.tasks("train")
    finally:
        pool.close()


def broken_root(env_kwargs, tmp_path) -> Path:
    """The synthetic data with `data/base_dbs` a file: AppWorld cannot load any task's start state, so every
    /initialize fails (a broken setup, as an unwritable home once was)."""
    root = tmp_path / "broken"
    shutil.copytree(env_kwargs["root"], root)
    shutil.rmtree(root / "data" / "base_dbs")
    (root / "data" / "base_dbs").write_text("")
    return root


@pytest.mark.parametrize(
    "entry, extra",
    [
        ("evaluate.py", ["split=dev", "k=2"]),
        ("train.py", ["trainer.devices=2", "parallelism.dp_shard=2"]),
    ],
)
def test_a_broken_setup_stops_training_and_evaluation_with_one_line(env_kwargs, tmp_path, warm_tiny, entry, extra):
    """Training on 2 processes (the rank that generates says why, and every rank stops: none dies on a broken pipe;
    one process takes the same path as that rank, so it is not run separately) and evaluation."""
    root, run_dir = broken_root(env_kwargs, tmp_path), tmp_path / "run"
    command = [
        sys.executable,
        entry,
        f"hydra.run.dir={run_dir}",
        f"model.tiny.dir={warm_tiny}",
        "model.tiny.format_warmup_steps=30",
        "env=appworld",
        "env.pool.workers=2",
        "env.pool.request_timeout_s=300",
        f"env.appworld.root={root}",
        "env.appworld.start_timeout_s=60",
        "data.tasks_per_step=2",
        "algorithm.group_size=2",
        "trainer.max_steps=1",
        "callbacks=none",
        "report.eval_samples_per_task=0",
        *extra,
    ]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1].split("\r")[-1].strip()
    what = "rollout step 0" if entry == "train.py" else "eval base"
    assert (
        last.startswith("environment error: the environment's serving layer is failing, not the agent: ")
        and what in last
    )
    assert "appworld_request_failed" in last and "/initialize answered 500: Exception: The base DB file" in last
    log = Path(re.search(r"\(server log: (\S+)\)", last).group(1))
    assert log.parent == run_dir / "env_logs" and "The base DB file for" in log.read_text()
    assert not (run_dir / "final_hf").exists()
    assert "Traceback" not in run.stderr and run.stderr.count("environment error:") == 1
