"""Reward integrity of python_tasks (issue 28): the agent's code, submitting a WRONG answer, tries to change its own
verdict or to quarantine its episode, through the real environment behind the pool (as in training). Each attack
must earn no more than its wrong answer deserves (1 of 2: an answer exists; 0 when no regular answer file
exists), and end as an ordinary verdict or the agent's own failure, never as a serving-layer fault."""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from canopy.envs.base import AgentFailure, EnvironmentFault, Task, Verdict
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.envs.python_tasks import PythonTaskEnvironment

SANDBOX = {"cpu_seconds": 2, "wall_seconds": 3.0, "memory_mb": 256, "max_processes": 8, "max_file_mb": 4}
SETTINGS = PoolSettings(workers=2, memory_mb=1024, request_timeout_s=9.0, health_timeout_s=2.0)
ROOT = os.geteuid() == 0
ANSWER_EXISTS, NO_ANSWER = Verdict(1, 2), Verdict(0, 2)


@pytest.fixture(scope="module")
def pool():
    pool = EnvironmentPool("canopy.envs.python_tasks:PythonTaskEnvironment", {"sandbox": SANDBOX}, SETTINGS)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def task(pool):
    return pool.tasks("train")[0]


def code(text: str) -> str:
    return f"```python\n{text}\n```"


def play(pool, task, action: str, settle_s: float = 0.0) -> tuple[Verdict, str]:
    """One episode of one action; the verdict (after `settle_s`, for leftover processes) and the observation."""
    episode = pool.start(task, seed=0)
    try:
        result = episode.step(code(action))
        time.sleep(settle_s)
        return episode.verdict(), result.observation
    finally:
        episode.close()


BACKGROUND = """import os, time
submit('wrong')
if os.fork() == 0:
    os.setsid()
    time.sleep(0.3)
    {act}
    os._exit(0)
"""

ATTACKS = {
    # exit statuses: the code's own, never the runner's setup failure (70 once quarantined the episode)
    "sys_exit_0": ("submit('wrong')\nimport sys; sys.exit(0)", ANSWER_EXISTS),
    "os_exit_setup_status": ("submit('wrong')\nimport os; os._exit(70)", ANSWER_EXISTS),
    "sys_exit_setup_status": ("submit('wrong')\nimport sys; sys.exit(70)", ANSWER_EXISTS),
    # the prelude and the checker: the code may replace `submit`; modules it plants are never imported by the worker
    "redefined_submit": ("def submit(value):\n    open('answer.txt', 'w').write('wrong')\nsubmit(42)", ANSWER_EXISTS),
    "planted_modules": (
        "for name in ('pathlib.py', 'os.py', 'sitecustomize.py', 'canopy.py'):\n"
        "    open(name, 'w').write('raise SystemExit')\nsubmit('wrong')",
        ANSWER_EXISTS,
    ),
    # the verdict file in other shapes
    "submitted_without_answer": ("open('.submitted', 'w').close()", NO_ANSWER),
    "symlink": ("import os\nopen('real', 'w').write('wrong')\nos.symlink('real', 'answer.txt')", NO_ANSWER),
    "symlink_loop": ("import os\nos.symlink('answer.txt', 'answer.txt')\nopen('.submitted', 'w').close()", NO_ANSWER),
    "hardlink": ("import os\nopen('real', 'w').write('wrong')\nos.link('real', 'answer.txt')", ANSWER_EXISTS),
    "fifo": ("import os\nos.mkfifo('answer.txt')\nopen('.submitted', 'w').close()", NO_ANSWER),
    "directory": ("import os\nos.mkdir('answer.txt')\nopen('.submitted', 'w').close()", NO_ANSWER),
    "socket": (  # issue 44: the verdict's open failed with ENXIO, once a quarantine (environment_error)
        "import socket\nsocket.socket(socket.AF_UNIX).bind('answer.txt')\nopen('.submitted', 'w').close()",
        NO_ANSWER,
    ),
    "huge_file": (
        "submit('wrong')\nf = open('answer.txt', 'a')\ntry:\n    while True:\n        f.write(' ' * 2**20)\n"
        "except OSError as error:\n    print('stopped:', error)",
        ANSWER_EXISTS,
    ),
    # a root verdict reads the file anyway; without root it is no answer (never a fault)
    "unreadable_answer": (
        "submit('wrong')\nimport os; os.chmod('answer.txt', 0)",
        ANSWER_EXISTS if ROOT else NO_ANSWER,
    ),
    "unreadable_scratch": ("submit('wrong')\nimport os; os.chmod('.', 0)", ANSWER_EXISTS if ROOT else NO_ANSWER),
    # outside the scratch directory
    "identity_rewrite": ("submit('wrong')\nopen('../identity', 'w').write('forged')", ANSWER_EXISTS),
    "identity_removal": ("submit('wrong')\nimport os; os.remove('../identity')", ANSWER_EXISTS),
    "signal_the_worker": ("submit('wrong')\nimport os, signal; os.kill(os.getppid(), signal.SIGKILL)", ANSWER_EXISTS),
    "signal_the_workers_group": ("submit('wrong')\nimport os; os.kill(-os.getpgid(os.getppid()), 9)", ANSWER_EXISTS),
    "write_the_workers_pipe": (  # fds 0 and 1 of the worker are its channel to the pool
        "submit('wrong')\nimport os\nfor fd in range(64):\n    try:\n"
        "        os.write(os.open(f'/proc/{os.getppid()}/fd/{fd}', os.O_WRONLY), b'\\0' * 64)\n        print('WROTE')\n"
        "    except OSError:\n        pass",
        ANSWER_EXISTS,
    ),
    "close_inherited_fds": ("submit('wrong')\nimport os\nos.closerange(0, 1024)", ANSWER_EXISTS),
    "memory_just_under_the_limit": (
        "submit('wrong')\nhog = bytearray(160 << 20)\nhog[::4096] = b'x' * len(hog[::4096])",
        ANSWER_EXISTS,
    ),
    "processes_each_under_the_limit": (
        "import os\nsubmit('wrong')\nfor _ in range(4):\n    if os.fork() == 0:\n        hog = bytearray(160 << 20)\n"
        "        hog[::4096] = b'x' * len(hog[::4096])\n        os._exit(0)\nfor _ in range(4):\n    os.wait()",
        ANSWER_EXISTS,
    ),
    "deep_folder_tree": (  # deeper than a recursive removal can go
        "import os\nsubmit('wrong')\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')",
        ANSWER_EXISTS,
    ),
    # a leftover process changing the verdict file after the step
    "late_right_answer": (BACKGROUND.format(act="open('answer.txt', 'w').write(ANSWER)"), ANSWER_EXISTS),
    "late_fifo_swap": (BACKGROUND.format(act="os.remove('answer.txt'); os.mkfifo('answer.txt')"), ANSWER_EXISTS),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_earns_no_undeserved_reward_and_no_quarantine(pool, task, name):
    action, deserved = ATTACKS[name]
    verdict, observation = play(pool, task, f"ANSWER = {task.spec['answer']!r}\n{action}", settle_s=0.6)
    assert verdict == deserved, observation  # an EnvironmentFault (quarantine) fails the test by raising


def test_crashing_its_own_process_is_the_agents_failure(pool, task):
    with pytest.raises(AgentFailure, match="agent_crashed"):
        play(pool, task, "submit('wrong')\nimport os, signal; os.kill(os.getpid(), signal.SIGKILL)")


def test_a_folder_tree_deeper_than_recursion_goes_leaves_nothing_behind():
    """Issue 44's own finding: 3,000 nested folders made Python's recursive `rmtree` raise past `ignore_errors`, so
    the pool's scratch folder stayed and every later pool's start failed while sweeping it. Removed by the episode
    (in-process), and by the pool when the worker that hosted it is killed."""
    env = PythonTaskEnvironment(SANDBOX)
    episode = env.start(env.tasks("train")[0], seed=0)
    episode.step(code(ATTACKS["deep_folder_tree"][0]))
    episode.close()
    assert not episode.home.exists()
    scratch = Path(tempfile.gettempdir()) / f"canopy-deep-test-{os.getpid()}"  # reachable by the sandbox users
    pool = EnvironmentPool("canopy.envs.python_tasks:PythonTaskEnvironment", {"sandbox": SANDBOX}, SETTINGS, scratch)
    try:
        pooled = pool.start(pool.tasks("train")[0], seed=0)
        pooled.step(code(ATTACKS["deep_folder_tree"][0]))
        os.kill(pooled.host.pid, signal.SIGKILL)  # its episode cannot remove the tree: the pool must
        with pytest.raises(EnvironmentFault, match="worker_killed"):
            pooled.verdict()
        pooled.close()
        assert not list(scratch.glob("w*/python_tasks/episode-*"))
    finally:
        pool.close()
    assert not scratch.exists()


def test_code_hung_in_a_system_call_is_the_agents_failure(pool, task):
    """Blocked in `pause()` with every signal it may block masked: the wall limit's SIGKILL still ends it, as the
    agent's timeout, within the worker's request timeout (never worker_unresponsive)."""
    hang = "import ctypes, signal\nsubmit('wrong')\nsignal.pthread_sigmask(signal.SIG_BLOCK, range(1, 65))\n"
    with pytest.raises(AgentFailure, match="agent_timeout"):
        play(pool, task, hang + "ctypes.CDLL(None).pause()")


def test_memory_past_the_limit_is_the_agents_failure(pool, task):
    with pytest.raises(AgentFailure, match="agent_memory"):
        play(pool, task, "submit('wrong')\nhog = bytearray(512 << 20)")


def injected(spec: dict):
    """A pool of the fault-injecting python tasks (canopy.envs.fault_injection) and a task carrying `spec`."""
    pool = EnvironmentPool("canopy.envs.fault_injection:FaultInjectingEnvironment", {"sandbox": SANDBOX}, SETTINGS)
    base = pool.tasks("train")[0]
    return pool, Task("full", base.tier, base.scenario, {**base.spec, **spec})


@pytest.mark.skipif(not ROOT, reason="mounts a small filesystem for the scratch folder")
@pytest.mark.parametrize("phase", ["step", "verdict"])
def test_a_scratch_filesystem_filled_by_another_tenant_is_quarantined(phase):
    """Issue 44: a tenant fills the scratch filesystem during the episode, so the agent's correct `submit` writes an
    empty answer (graded wrong before); the episode is quarantined, naming the evidence."""
    pool, task = injected({"inject": "scratch_full", "phase": phase})
    try:
        with pytest.raises(EnvironmentFault) as fault:
            play(pool, task, f"submit({task.spec['answer']!r})")
        assert fault.value.reason == "scratch_full" and "another tenant filled it" in fault.value.detail
    finally:
        pool.close()


@pytest.mark.skipif(not ROOT, reason="mounts a small filesystem for the scratch folder")
def test_a_scratch_filesystem_the_agent_filled_is_its_own_doing():
    """The same 8 MiB filesystem filled by the agent's own code: graded as it stands, never quarantined."""
    pool, task = injected({"scratch_mb": 8})
    fill = "f = open('junk', 'wb')\ntry:\n    while True:\n        f.write(b'x' * 65536)\nexcept OSError:\n    pass\n"
    try:
        assert play(pool, task, f"{fill}submit({task.spec['answer']!r})")[0] in (ANSWER_EXISTS, Verdict(2, 2))
        assert play(pool, task, f"submit({task.spec['answer']!r})")[0] == Verdict(2, 2)  # room: a clean episode
    finally:
        pool.close()


def test_the_worker_memory_and_files_stay_closed(pool, task):
    """The expected answer lives in the worker: its /proc entries that could show it are closed to the code."""
    probe = """import os
worker = f'/proc/{os.getppid()}/'
for name, attempt in [(name, lambda: open(worker + name, 'rb').close()) for name in ('environ', 'maps', 'mem')] + [
        (name, lambda: os.listdir(worker + name)) for name in ('cwd', 'fd')]:
    try:
        attempt()
        print(name, 'OPENED')
    except OSError:
        print(name, 'closed')
submit('wrong')"""
    verdict, observation = play(pool, task, probe)
    assert verdict == ANSWER_EXISTS and "OPENED" not in observation and observation.count("closed") == 5


@pytest.mark.skipif(not ROOT, reason="without root every sandbox shares one uid and file modes protect nothing")
def test_a_concurrent_siblings_scratch_can_be_neither_read_nor_written(pool, task):
    """GRPO samples a task's group concurrently: a sibling's answer must not be copyable, even by code that knows
    its path (a running sandbox's path shows in /proc/<pid>/cmdline)."""
    honest, cheat = pool.start(task, seed=0), pool.start(task, seed=1)
    try:
        where = honest.step(code(f"import os\nprint(os.getcwd())\nsubmit({task.spec['answer']!r})")).observation
        sibling = where.strip()
        attack = f"""import glob
print('listed', glob.glob({sibling + "/../../*"!r}) + glob.glob('../../*'))
try:
    submit(open({sibling + "/answer.txt"!r}).read())
    print('COPIED')
except OSError:
    submit('wrong')
try:
    open({sibling + "/planted"!r}, 'w').write('x'); print('WROTE')
except OSError:
    print('write blocked')"""
        observation = cheat.step(code(attack)).observation
        assert "COPIED" not in observation and "WROTE" not in observation, observation
        assert "listed []" in observation, observation
        assert cheat.verdict() == ANSWER_EXISTS and honest.verdict() == Verdict(2, 2)
    finally:
        honest.close()
        cheat.close()


def test_later_episodes_are_untouched_by_a_leftover_process(pool, task):
    """A process left behind tries to plant the answer file of the next episodes (one per worker)."""
    plant = "\n".join(
        [
            "import glob, os, time",
            "if os.fork() == 0:",
            "    os.setsid()",
            "    for _ in range(400):",
            "        for path in glob.glob('../../*/scratch') + glob.glob('/tmp/canopy-*/w*/python_tasks/*/scratch'):",
            "            try:",
            "                open(path + '/answer.txt', 'w').write(ANSWER)",
            "            except OSError:",
            "                pass",
            "        time.sleep(0.01)",
            "    os._exit(0)",
        ]
    )
    play(pool, task, f"ANSWER = {task.spec['answer']!r}\n{plant}")
    for _ in range(SETTINGS.workers):
        assert play(pool, task, "print('idle')", settle_s=0.3)[0] == NO_ANSWER


def test_in_process_episodes_running_at_once_do_not_kill_each_other():
    """In-process (env.pool.workers=0, a concurrent engine): episodes step in threads of their own and their
    sandboxes share one uid, which each ends by killing: one episode's quick step killed a sibling's code."""
    env = PythonTaskEnvironment(SANDBOX)
    task = env.tasks("train")[0]
    slow, fast = env.start(task, seed=0), env.start(task, seed=1)
    results = {}
    thread = threading.Thread(
        target=lambda: results.update(
            slow=slow.step(code(f"import time; time.sleep(1)\nsubmit({task.spec['answer']!r})"))
        )
    )
    try:
        thread.start()
        time.sleep(0.3)
        listing = fast.step(code("import glob\nprint(glob.glob('../../*'))\nsubmit('wrong')")).observation
        thread.join(timeout=30)
        assert results["slow"].done and slow.verdict() == Verdict(2, 2)
        assert fast.verdict() == ANSWER_EXISTS
        assert listing.strip() == "[]" or not ROOT  # siblings' folders cannot be listed
    finally:
        slow.close()
        fast.close()


def test_the_verdict_cannot_be_raced():
    """Without root a leftover process survives its step (no uid to kill by), so the answer file can change while
    the verdict reads it: swapped for a FIFO after its check (the read would hang: quarantine) or a symlink (another
    file judged). A process here plays that leftover, swapping answer.txt atomically between the three as fast as it
    can; every verdict must judge a regular file or none, and none may hang."""
    env = PythonTaskEnvironment(SANDBOX)
    episode = env.start(env.tasks("train")[0], seed=0)
    scratch = episode.scratch
    (scratch / "regular").write_text("wrong")
    os.mkfifo(scratch / "fifo")
    (scratch / "symlink").symlink_to("/etc/hostname")
    swap = (
        "import os\nos.chdir(os.sys.argv[1])\nwhile True:\n    for name in ('regular', 'fifo', 'symlink'):\n"
        "        os.link(name, 'next', follow_symlinks=False)\n        os.replace('next', 'answer.txt')"
    )
    swapper = subprocess.Popen([sys.executable, "-c", swap, str(scratch)])
    verdicts = []

    def judge_for(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            verdicts.append(episode.verdict())

    judge = threading.Thread(target=judge_for, args=(2.0,), daemon=True)
    try:
        while not os.path.lexists(scratch / "answer.txt"):
            time.sleep(0.01)
        judge.start()
        judge.join(timeout=10)
        assert not judge.is_alive(), "the verdict hung on the swapped answer file"
        assert verdicts and set(verdicts) <= {ANSWER_EXISTS, NO_ANSWER}
    finally:
        swapper.kill()
        swapper.wait()
        episode.close()
