"""The sandbox confines the policy's code and says whose fault an abnormal end was (Appendix G)."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from canopy.envs import sandbox
from canopy.envs.base import EnvironmentFault
from canopy.envs.sandbox import SandboxLimits, prepare_scratch, run_sandboxed, sandbox_uid

LIMITS = SandboxLimits(
    cpu_seconds=1, wall_seconds=3.0, memory_mb=256, max_processes=8, max_file_mb=1, max_output_chars=500
)


@pytest.fixture
def scratch():
    root = Path(tempfile.mkdtemp(prefix="canopy-test-"))  # pytest's tmp dirs are closed to the sandbox user
    root.chmod(0o711)
    yield prepare_scratch(root / "scratch")
    shutil.rmtree(root, ignore_errors=True)


def run(code, scratch):
    return run_sandboxed(code, scratch, LIMITS)


def test_ordinary_code_runs_in_its_scratch_dir(scratch):
    result = run("import os\nprint(sum(range(10)))\nopen('out.txt', 'w').write(os.getcwd())", scratch)
    assert (result.status, result.output.strip(), result.returncode) == ("ok", "45", 0)
    assert (scratch / "out.txt").read_text() == str(scratch)
    assert not result.agent_fault


@pytest.mark.parametrize("code, error", [("def broken(:", "SyntaxError"), ("1 / 0", "ZeroDivisionError")])
def test_errors_are_observations_not_faults(scratch, code, error):
    result = run(code, scratch)
    assert result.status == "error" and error in result.output and not result.agent_fault


@pytest.mark.parametrize(
    "code, status",
    [
        ("while True:\n    pass", "timeout"),  # CPU limit
        ("import time\ntime.sleep(60)", "timeout"),  # wall limit
        ("hog = bytearray(8 * 2**30)", "memory"),
        ("hog = []\nwhile True:\n    hog.append(' ' * 2**20)", "memory"),
        ("import os\nwhile True:\n    os.fork()", "processes"),
        ("import os\nos.abort()", "crashed"),
    ],
)
def test_agent_faults_are_named(scratch, code, status):
    result = run(code, scratch)
    assert result.status == status and result.agent_fault


def test_no_writes_outside_scratch_no_network_no_signals(scratch):
    target = scratch.parent / "outside.txt"
    code = f"""
import os, signal, socket
for name, attempt in [('write', lambda: open({str(target)!r}, 'w').write('x')),
                      ('tmp', lambda: open('/tmp/canopy-sandbox-escape', 'w').write('x')),
                      ('net', lambda: socket.create_connection(('127.0.0.1', 22), timeout=1)),
                      ('kill', lambda: os.kill(os.getppid(), signal.SIGKILL))]:
    try:
        attempt()
        print(name, 'ESCAPED')
    except OSError as error:
        print(name, 'blocked', type(error).__name__)
"""
    result = run(code, scratch)
    assert result.status == "ok", result.output
    assert "ESCAPED" not in result.output and result.output.count("blocked") == 4
    assert not target.exists() and not os.path.exists("/tmp/canopy-sandbox-escape")


def test_fork_bomb_leaves_no_process_behind(scratch):
    code = (
        "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(600)\n"
        "print('parent done')"
    )
    result = run(code, scratch)
    assert result.status == "ok"
    uid = sandbox_uid()
    if uid is not None:  # escaped (setsid) sleepers were killed by uid
        owners = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"{entry.path}/stat") as f:
                        state = f.read().rsplit(")", 1)[1].split()[0]
                    owners.append((entry.stat().st_uid, state))
                except (FileNotFoundError, ProcessLookupError):
                    pass
        assert (uid, "S") not in owners and (uid, "R") not in owners, [o for o in owners if o[0] == uid]


def test_orphans_are_adopted_only_while_a_sandbox_runs(scratch):
    """After a sandbox, the orphans of whatever else this process starts go to init, not to a parent that never
    waits for them (a subreaper for good piled up 766 zombies under one test process)."""
    assert run("print(1)", scratch).status == "ok"
    sleepers = [
        int(subprocess.run(["sh", "-c", "sleep 0.1 & echo $!"], capture_output=True, text=True, check=True).stdout)
        for _ in range(3)
    ]  # each outlives its shell: an orphan
    time.sleep(1)
    assert [pid for pid in sleepers if parent_of(pid) == os.getpid()] == []


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return None


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox user exists only when running as root")
def test_scratch_dir_the_sandbox_user_cannot_reach_is_a_clear_setup_fault(tmp_path):
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(EnvironmentFault, match="closed to the sandbox user"):
        prepare_scratch(closed / "scratch")


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are claimed only when running as root")
def test_claiming_a_uid_kills_what_its_dead_holder_left_running(monkeypatch):
    """Code that escaped a killed run's sandbox still runs as its uid: it would eat the next holder's process
    limit and could signal the next holder's processes."""
    monkeypatch.setattr(sandbox, "FIRST_UID", 70003 + os.getpid() % 10000 * 10)  # a uid range of our own
    uid, lock = sandbox.claim_uid()
    spawn = ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"]  # an orphan of init, like a dead run's leftover
    leftover = int(subprocess.run(spawn, user=uid, group=uid, extra_groups=[], capture_output=True).stdout)
    os.close(lock)  # its holder is gone; the leftover is not
    assert os.path.exists(f"/proc/{leftover}")
    again, lock = sandbox.claim_uid()
    try:
        assert again == uid
        assert not os.path.exists(f"/proc/{leftover}")
    finally:
        os.close(lock)


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are claimed only when running as root")
def test_a_uid_claimed_here_is_claimed_for_a_process_with_another_tmpdir(monkeypatch, tmp_path):
    """Ray's nodes run with a TMPDIR of their own; claims made there once missed this process's, and each side
    killed the other's sandboxes (a Ray test's episodes crashed under load)."""
    first_uid = 70006 + os.getpid() % 10000 * 10
    monkeypatch.setattr(sandbox, "FIRST_UID", first_uid)
    uid, lock = sandbox.claim_uid()
    claim = f"import canopy.envs.sandbox as s; s.FIRST_UID = {first_uid}; print(s.claim_uid()[0])"
    try:
        other = subprocess.run(
            [sys.executable, "-c", claim], env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True
        )
        assert (uid, int(other.stdout)) == (first_uid, first_uid + 1), other.stderr
    finally:
        os.close(lock)


def test_output_flood_is_cut(scratch):
    result = run("while True:\n    print('x' * 1000)", scratch)
    assert len(result.output) <= LIMITS.max_output_chars and not result.agent_fault


def test_confined_server_command_has_no_network_and_writes_only_where_allowed(scratch):
    import subprocess
    import sys

    from canopy.envs.sandbox import confined

    outside = scratch.parent / "outside.txt"
    probe = (
        f"import socket\nopen({str(scratch / 'inside.txt')!r}, 'w').write('ok')\n"
        f"for attempt in (lambda: open({str(outside)!r}, 'w'), lambda: socket.create_connection(('127.0.0.1', 22), "
        "timeout=1)):\n"
        "    try:\n        attempt()\n        print('ESCAPED')\n    except OSError:\n        print('blocked')"
    )
    run = subprocess.run(
        confined([sys.executable, "-c", probe], writable=[scratch]), capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["blocked", "blocked"]
    assert (scratch / "inside.txt").read_text() == "ok" and not outside.exists()


SIGNALS = """import os, signal, subprocess, sys, threading
def attempt(name, send):
    try:
        send()
        print(name, "sent")
    except OSError:
        print(name, "refused")
signal.signal(signal.SIGUSR1, lambda *args: print("usr1 received"))
attempt("usr1_to_itself", lambda: signal.raise_signal(signal.SIGUSR1))
attempt("probe_itself", lambda: os.kill(os.getpid(), 0))
attempt("sigkill_itself", lambda: os.kill(os.getpid(), signal.SIGKILL))
attempt("sigkill_its_thread", lambda: signal.pthread_kill(threading.get_ident(), signal.SIGKILL))
attempt("term_to_parent", lambda: os.kill(os.getppid(), signal.SIGTERM))
attempt("term_to_its_group", lambda: os.killpg(0, signal.SIGTERM))
child = subprocess.run([sys.executable, "-c", "import os; os.kill(os.getppid(), 9)"], capture_output=True)
print("child", "refused" if child.returncode else "sent")
"""


def test_a_confined_server_signals_only_itself_and_never_sends_sigkill(scratch):
    """Issue 44: AppWorld's policy code once killed its own server with SIGKILL, which was quarantined. Under
    `confined`, SIGKILL reaches nothing (itself, its threads, from a child) and other signals reach only itself, so a
    SIGKILL death came from outside."""
    worker = (  # stands for the worker: the confined process's parent, in a session of its own
        "import subprocess, sys\nfrom canopy.envs.sandbox import confined\n"
        "done = subprocess.run(confined([sys.executable, '-c', sys.argv[1]], writable=[sys.argv[2]]))\n"
        "print('worker alive')\nsys.exit(done.returncode)"
    )
    run = subprocess.run(
        [sys.executable, "-c", worker, SIGNALS, str(scratch)],
        capture_output=True, text=True, timeout=60, start_new_session=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:-1] == [
        "usr1 received",
        "usr1_to_itself sent",
        "probe_itself sent",
        "sigkill_itself refused",
        "sigkill_its_thread refused",
        "term_to_parent refused",
        "term_to_its_group refused",
        "child refused",
        "worker alive",
    ]


def test_per_user_folders_of_libraries_land_in_the_scratch_dir(scratch, monkeypatch):
    """Whatever a library creates on first use (~/.ipython, ~/.cache/..., $HF_HOME) goes below the scratch dir,
    even when the caller's environment points those variables elsewhere."""
    monkeypatch.setenv("XDG_CACHE_HOME", "/root/.cache")
    monkeypatch.setenv("HF_HOME", "/root/.cache/huggingface")
    code = (
        "import os\n"
        "for name in ('HOME', 'XDG_CACHE_HOME', 'XDG_CONFIG_HOME', 'IPYTHONDIR', 'MPLCONFIGDIR', 'HF_HOME', "
        "'TRITON_CACHE_DIR'):\n"
        "    os.makedirs(os.path.join(os.environ[name], 'made'), exist_ok=True)\n"
        "os.makedirs(os.path.expanduser('~/.ipython/profile_default'))\n"
        "print('ok')"
    )
    result = run(code, scratch)
    assert result.status == "ok", result.output
    assert (scratch / ".ipython" / "profile_default").is_dir() and (
        scratch / ".cache" / "huggingface" / "made"
    ).is_dir()
