"""AppWorld (Trivedi et al. 2024), the paper's benchmark (Section 4.1, Table A1), served as Appendix G asks.

AppWorld needs its own venv (pydantic<2: `make appworld`) and holds one live world per process, so every
pool worker runs its own AppWorld environment server, `appworld.serve.environment:app` (the app `appworld
serve environment` runs), started lazily with that venv's python and health-checked. It listens on a private
unix socket, not a port: it executes the policy's code, so it must not be reachable from the network, and 64
workers cannot collide on ports. Every episode initializes a fresh world under a unique experiment name whose
outputs (AppWorld's saved end state and logs) lie in the server's own folder, deleted at close.

Reward integrity (issue 28). The policy's code runs inside that server, where AppWorld's safety guard is no
barrier (`__import__`, `io.FileIO`, `sqlite3.Connection`, `gc` and `sys.modules` all pass it), so the server runs
`confined`: no network, no capabilities, writes only beneath its own folder (also its home, `private_home`), and
in a mount namespace where every task's `ground_truth/`, the root's `experiments/` and the other servers' folders
are empty read-only folders; its worlds are initialized without ground truth. So the policy's code can read the
task's start state, the API docs and the installed packages, and change its own world and server as it likes
(monkeypatching included), but cannot read any answer or evaluation, another episode's state, or change any file
outside its folder. The verdict is not the server's: `AppWorldGrader`, a process of its own that runs no policy
code, runs AppWorld's evaluator (`evaluate_task`) on the task's ground truth and start state from the data root and
on a copy of the world's end state (symlinks dropped) taken from the server's folder after the last step. Left to
the policy: its own end state, which is what is graded; a thread it leaves running in the server lives on into
the server's next episodes.

Episode: the ReAct-style prompt of AppWorld's agents (supervisor identity, app descriptions, API-doc
discovery, `apis.supervisor.complete_task`); each reply's ```python``` block runs in the world; the episode
ends once the supervisor's task is marked complete. The verdict is AppWorld's own evaluation of the task's
ground-truth unit tests, Verdict(passes, num_tests): sparse = success, dense = pass fraction.

Fault attribution, from AppWorld's real behaviour:
- The agent's exceptions, syntax errors, forbidden calls (`os._exit` ...) and infinite loops come back as
  AppWorld's "Execution failed. Traceback: ..." observations (its per-cell timeout, `cell_timeout_s`, stops a
  loop), as in AppWorld's own harness: the episode goes on and, unless the agent recovers, ends at the turn
  limit with reward 0. Such a failure before any API call (the world's API-call log did not grow: a syntax error,
  refused code, or an exception or timeout before the first call), like a reply without a code block, is an
  invalid action (`StepResult.valid`, format health); a failure after a call is a valid action that went wrong.
- A server that fails while it runs the agent's code, or on the `/task_completed` call right after it, is the
  agent's doing (`AgentFailure`, scored 0; its server is replaced): code that outlives that timeout anyway (it
  swallows the alarm or blocks in C: `agent_timeout`), code that broke the request executing it or the one after
  (it tampered with AppWorld's objects, `task_completed` included: `agent_broke_world`), code that killed or crashed
  its own server (`agent_killed_server`: `raise_signal(SIGSEGV)`, `os.abort()`, an exit). Only evidence from
  outside the agent's reach makes it the serving layer's: a SIGKILL death (`appworld_server_killed`: the confined
  server may signal nothing but itself and never send SIGKILL, and the worker's address-space cap turns its memory
  bombs into MemoryError observations, so the kill came from outside: kill -9, the kernel's OOM killer), or a
  scratch filesystem filled by another tenant (`scratch_full`, `canopy.envs.attribution`).
- An end state the grader cannot load (the agent's code wrote over its saved databases), or larger than
  `MAX_END_STATE_BYTES`, scores 0 of the task's tests, with the outcome `end_state_unloadable` (the error is in the
  grader's log).
- Everything else is the serving layer's and quarantines the episode (`EnvironmentFault`): the server died
  (`appworld_server_died`) or could not start (`appworld_server_start_failed`), a request that runs no agent
  code (/initialize, /close) failed (`appworld_request_failed`) or outlived `request_timeout_s`
  (`appworld_server_unresponsive`), the grader gave no verdict (`appworld_grader_failed`),
  or the server's live world is not the episode's (`cross_episode_corruption`; AppWorld also refuses a
  request for another task than its world's).
"""

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from canopy.envs.attribution import policy_folders, scratch_fault, scratch_root, usage
from canopy.envs.base import (
    AgentFailure,
    EnvironmentFault,
    StepResult,
    Task,
    Verdict,
    extract_code,
    keep_fault_log,
    last_line,
)
from canopy.envs.isolation.base import remove_tree
from canopy.envs.pool import PoolSettings
from canopy.envs.sandbox import confined, private_home
from canopy.errors import require

SYSTEM_PROMPT = """\
I am your supervisor, and you are a super intelligent AI assistant whose job is to achieve my day-to-day tasks \
completely autonomously.

To do this, you will interact with app(s) (e.g., spotify, venmo) through their APIs on my behalf, in a multi-step \
conversation with a Python REPL: you write Python code, the environment executes it and shows you the output, and \
based on it you write the code of the next step, until the task is done.

The apps available to you:
{apps}

Three APIs tell you more:

```python
# the apps available to you
print(apis.api_docs.show_app_descriptions())
# the APIs of an app, e.g. supervisor
print(apis.api_docs.show_api_descriptions(app_name='supervisor'))
# the specification of one API, e.g. supervisor's show_account_passwords
print(apis.api_docs.show_api_doc(app_name='supervisor', api_name='show_account_passwords'))
```

Key instructions:
- Reply with your reasoning and exactly one ```python``` code block; variables persist across steps.
- Act fully on your own: never ask me to confirm or clarify, never guess values or leave placeholders; look \
them up through the APIs. My personal information and account passwords are in the supervisor app; people I \
mention are in my phone contacts.
- Read an API's specification before calling it. Paginated APIs: loop over page_index until all results are seen.
- Use the apps' APIs only, not the machine's OS or other Python packages; print what you need to see.
- Do only what I ask; avoid collateral changes.
- When the task is done, call `apis.supervisor.complete_task()`; if it asks for information, pass it as \
`apis.supervisor.complete_task(answer=<answer>)`, minimal (an entity, a number), numbers as digits. If you \
cannot do the task, call `apis.supervisor.complete_task(status="fail")`."""
TASK_PROMPT = """\
My name is: {first_name} {last_name}. My personal email is {email} and phone number is {phone_number}.
Task: {instruction}"""
SPLITS = ("train", "dev", "test_normal", "test_challenge")
EXECUTION_FAILED = "Execution failed."  # how AppWorld's output of a syntax error, refused code or an exception begins
SOCKET_PATH_MAX = 107  # bytes: Linux's sun_path holds 108 with the terminating NUL
SERVER_HOME_PREFIX, SERVER_SOCKET = "appworld-", "server.sock"  # <scratch>/appworld-XXXXXXXX/server.sock
MAX_END_STATE_BYTES = 1 << 30  # an end state past this is the agent's doing and scores 0 (AppWorld's are megabytes)
POLICY_FOLDERS = (f"{SERVER_HOME_PREFIX}*",)  # below a scratch root: the servers' homes, where the policy's code writes


def appworld_scratch() -> Path:
    """Where servers and graders keep their homes: the pool worker's scratch folder (cleared with the worker), else
    a folder of their own under the temporary directory (never the whole of it: its homes are hidden from servers).
    A server's socket lies two levels below it, so its path must leave room for them."""
    scratch = scratch_root("canopy-appworld")
    socket_bytes = len(os.fsencode(scratch / f"{SERVER_HOME_PREFIX}xxxxxxxx" / SERVER_SOCKET))  # mkdtemp adds 8
    if socket_bytes > SOCKET_PATH_MAX:
        raise ValueError(
            f"AppWorld's server sockets would be {socket_bytes} bytes long under {scratch}, over the "
            f"{SOCKET_PATH_MAX} a unix socket path may have: give the environment pool a shorter scratch root"
        )
    scratch.mkdir(parents=True, exist_ok=True)
    return scratch


class AppWorldServer:
    """One `appworld.serve.environment` process on a private unix socket, and the world it holds."""

    def __init__(self, python: str, root: str, start_timeout_s: float, request_timeout_s: float):
        scratch = appworld_scratch()
        self.home = Path(tempfile.mkdtemp(prefix=SERVER_HOME_PREFIX, dir=scratch))
        self.socket, self.log = self.home / SERVER_SOCKET, self.home / "server.log"
        self.outputs = self.home / "outputs"  # its worlds' outputs (AppWorld's experiments/outputs), graded from here
        self.request_timeout_s = request_timeout_s
        self.world: tuple[str, str] | None = None  # (task id, experiment name) of the live world
        env = {
            **os.environ,
            **private_home(self.home / "home"),
            "TMPDIR": str(self.home / "tmp"),
            "APPWORLD_ROOT": root,
        }
        (self.home / "tmp").mkdir()
        self.outputs.mkdir()
        # Hidden from the policy's code: every task's ground truth, the root's experiment outputs, and the other
        # servers' and graders' homes (this process's folder; in a pool, all workers' folders, side by side). The
        # data root and AppWorld's venv stay visible wherever they lie.
        others = scratch.parent if os.environ.get("CANOPY_SCRATCH_ROOT") else scratch
        hidden = [others, Path(root) / "experiments", *Path(root).glob("data/tasks/*/ground_truth")]
        shown = [root, Path(python).parent.parent, Path(python).resolve().parent.parent]
        with open(self.log, "wb") as log:
            server = [
                python,
                "-m",
                "uvicorn",
                "appworld.serve.environment:app",
                "--uds",
                str(self.socket),
                "--log-level",
                "warning",
            ]
            self.process = subprocess.Popen(
                confined(server, writable=[self.home], hidden=[p for p in hidden if p.is_dir()], shown=shown),
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        self.client = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://appworld")
        deadline = time.monotonic() + start_timeout_s
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                status = self.process.poll()
                what = (
                    f"exited with status {status}"
                    if status is not None
                    else f"not healthy within {start_timeout_s:.0f} s"
                )
                fault = self.fault("appworld_server_start_failed", what)
                self.stop()
                raise fault
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            return self.process.poll() is None and self.client.get("/", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def dead(self) -> bool:
        """Whether the process has exited (a killed one may take a moment to be reaped)."""
        try:
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return False
        return True

    def fault(self, reason: str, what: str) -> EnvironmentFault:
        """A serving fault naming the server log's last line and a kept copy of the log (`keep_fault_log`)."""
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        kept = keep_fault_log(self.log, f"{self.home.name}.log")
        return EnvironmentFault(reason, f"{what}: {last_line(text)} (server log: {kept})")

    def call(self, method: str, timeout: float | None = None, **body):
        """POST /{method}; transport failures and error replies raise `EnvironmentFault`."""
        try:
            reply = self.client.post(f"/{method}", json=body, timeout=timeout or self.request_timeout_s)
        except httpx.TimeoutException:
            raise EnvironmentFault(
                "appworld_server_unresponsive", f"/{method} got no reply in {timeout or self.request_timeout_s:.0f} s"
            )
        except httpx.TransportError as error:
            if self.dead():
                raise self.fault("appworld_server_died", f"exit status {self.process.returncode} during /{method}")
            raise EnvironmentFault("appworld_request_failed", f"/{method}: {error!r}")
        if reply.status_code != 200:
            raise self.fault("appworld_request_failed", f"/{method} answered {reply.status_code}")
        return reply.json()["output"]

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.client.close()
        remove_tree(self.home)


class AppWorldEpisode:
    def __init__(self, env: "AppWorldEnvironment", task: Task, seed: int):
        self.env, self.task = env, task
        self.server = env.server()
        # An absolute experiment name puts the world's outputs in the server's home (AppWorld joins it to its root).
        self.experiment = str(self.server.outputs / f"canopy-{uuid.uuid4().hex}")
        self.info = self.server.call(
            "initialize",
            task_id=task.task_id,
            experiment_name=self.experiment,
            random_seed=seed,
            timeout_seconds=env.cell_timeout_s,
            load_ground_truth=False,  # the world the policy's code runs in never holds the answer
        )  # instruction, supervisor
        self.server.world = (task.task_id, self.experiment)
        self.closed = False

    def messages(self) -> list[dict]:
        system = SYSTEM_PROMPT.format(
            apps="\n".join(f"- {name}: {text}" for name, text in self.env.app_descriptions.items())
        )
        return [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": TASK_PROMPT.format(**self.info["supervisor"], instruction=self.info["instruction"]),
            },
        ]

    def _check_identity(self) -> None:
        """The server must still be the one that built this episode's world, holding that world."""
        if self.env.live is not self.server or self.server.world != (self.task.task_id, self.experiment):
            held = self.env.live.world if self.env.live else None
            raise EnvironmentFault(
                "cross_episode_corruption", f"episode {self.task.task_id}/{self.experiment}, server holds {held}"
            )

    def step(self, action_text: str) -> StepResult:
        self._check_identity()
        code = extract_code(action_text)
        if code is None:
            text = "No ```python``` code block found. Reply with exactly one code block."
            return StepResult(text, done=False, valid=False)
        calls = self._api_call_log_size()
        try:
            output = self.server.call(
                "execute", timeout=self.env.cell_timeout_s + 15, task_id=self.task.task_id, code=code
            )
            failed_first = output.startswith(EXECUTION_FAILED) and self._api_call_log_size() == calls
            done = self.server.call("task_completed", task_id=self.task.task_id)
        except EnvironmentFault as fault:
            self.env.discard_server()
            raise self._blame(fault) from None
        return StepResult(output[: self.env.max_observation_chars], done=bool(done), valid=not failed_first)

    def _blame(self, fault: EnvironmentFault) -> Exception:
        """Whose fault a server failure was while it ran the policy's code or the call right after it (the
        attribution rule, docs/environments.md): the agent's, unless evidence from outside its reach says otherwise.
        A full scratch filesystem that the policy's folders hold little of is the serving layer's (`scratch_full`);
        so is a SIGKILL death, which the server's code cannot send (seccomp: `confined`), nor cause by memory (the
        worker's address-space cap turns its allocations into a MemoryError). Any other death (its own signal, an
        exit, a crash), a hang or a failed request is the agent's."""
        full = scratch_fault(self.server.home, lambda: policy_folders(appworld_scratch(), POLICY_FOLDERS))
        if full is not None:
            return full
        status = self.server.process.returncode
        if fault.reason == "appworld_server_died" and status == -signal.SIGKILL:
            return EnvironmentFault(
                "appworld_server_killed", f"{fault.detail}: SIGKILL, which the server's code cannot send (seccomp)"
            )
        if fault.reason == "appworld_server_died":
            return AgentFailure("agent_killed_server", f"{fault.detail}: the policy's code ran in it")
        reason = "agent_timeout" if fault.reason == "appworld_server_unresponsive" else "agent_broke_world"
        return AgentFailure(reason, str(fault))

    def _api_call_log_size(self) -> int:
        """The size of the world's API-call log, which AppWorld rewrites (a line per call of the world so far) after
        every execution it runs: it grows exactly when the code called an API. Read from here, never opened."""
        try:
            return (Path(self.experiment) / "tasks" / self.task.task_id / "logs" / "api_calls.jsonl").lstat().st_size
        except OSError:
            return 0  # none yet (no execution ran), or the policy's code removed it

    def verdict(self) -> Verdict:
        """AppWorld's evaluation, by the grader, of this world's end state as AppWorld saved it after the last step."""
        self._check_identity()
        return self.env.grader().grade(self.task.task_id, Path(self.experiment) / "tasks" / self.task.task_id / "dbs")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.env.live is self.server and self.server.world == (self.task.task_id, self.experiment):
            try:
                self.server.call("close", task_id=self.task.task_id)
                self.server.world = None
            except EnvironmentFault:
                self.env.discard_server()
        remove_tree(self.experiment)


GRADER = """
import json, os, sys
from appworld.apps.model_lib import CachedDBHandler
from appworld.evaluator import evaluate_task
from appworld.task import Task

reply, sys.stdout = sys.stdout, sys.stderr  # only replies go to stdout
for line in sys.stdin:
    request = json.loads(line)
    try:
        tracker = evaluate_task(request["task_id"], request["experiment"], suppress_errors=True, save_report=False)
        answer = {"passed": len(tracker.passes), "total": tracker.num_tests}
    except Exception as error:  # an end state AppWorld cannot load: the policy's code wrote it
        total = len(Task.load(task_id=request["task_id"]).ground_truth.test_data)
        answer = {"passed": 0, "total": total, "outcome": "end_state_unloadable"}
        print(f"{request['task_id']}: end state unloadable: {type(error).__name__}: {error}", flush=True)
    CachedDBHandler.reset()
    reply.write(json.dumps(answer) + "\\n")
    reply.flush()
"""


class AppWorldGrader:
    """AppWorld's evaluator (`appworld.evaluator.evaluate_task`) in a process of its own that runs no policy code:
    it reads the task's ground truth and start state from the data root, and a world's end state from a copy that
    `grade` takes out of the world server's home (what the policy's code could write)."""

    def __init__(self, python: str, root: str, timeout_s: float):
        self.home, self.timeout_s = Path(tempfile.mkdtemp(prefix="appworld-grader-", dir=appworld_scratch())), timeout_s
        env = {**os.environ, **private_home(self.home / "home"), "TMPDIR": str(self.home), "APPWORLD_ROOT": root}
        with open(self.home / "grader.log", "wb") as log:
            self.process = subprocess.Popen(
                confined([python, "-c", GRADER], writable=[self.home]),
                cwd=root,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    def grade(self, task_id: str, end_state: Path) -> Verdict:
        """The verdict on `end_state` (a world's saved databases); symlinks in it are not followed, and one larger
        than MAX_END_STATE_BYTES is not copied (the grader would take past its timeout: a quarantine)."""
        copy = self.home / uuid.uuid4().hex
        try:
            real = os.path.realpath(end_state) == str(end_state) and end_state.is_dir()
            if real and usage([end_state], os.stat(end_state).st_dev)[0] <= MAX_END_STATE_BYTES:
                skip_links = lambda folder, names: [n for n in names if os.path.islink(os.path.join(folder, n))]  # noqa: E731
                shutil.copytree(end_state, copy / "tasks" / task_id / "dbs", symlinks=True, ignore=skip_links)
        except (OSError, shutil.Error, RecursionError):
            pass  # an end state that cannot be copied (a named pipe...) is graded as missing: unloadable, 0
        try:
            self.process.stdin.write(json.dumps({"task_id": task_id, "experiment": str(copy)}) + "\n")
            self.process.stdin.flush()
            ready, _, _ = select.select([self.process.stdout], [], [], self.timeout_s)
            line = self.process.stdout.readline() if ready else ""
        except (BrokenPipeError, ValueError):
            line = ""
        finally:
            remove_tree(copy)
        if not line:
            log = (self.home / "grader.log").read_text(errors="replace")
            kept = keep_fault_log(self.home / "grader.log", f"{self.home.name}.log")
            raise EnvironmentFault(
                "appworld_grader_failed", f"no verdict for {task_id}: {last_line(log)} (log: {kept})"
            )
        answer = json.loads(line)
        return Verdict(passed=answer["passed"], total=answer["total"], outcome=answer.get("outcome", ""))

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        remove_tree(self.home)


@functools.cache
def app_descriptions(python: str, timeout_s: float) -> dict[str, str]:
    """The apps' one-line descriptions (the system prompt lists them), read once per AppWorld python: they come from
    the installed package, not the data root."""
    code = "import json; from appworld.apps import APP_TO_DESCRIPTION as d; print(json.dumps(d))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=timeout_s)
    return {name: text.strip() for name, text in json.loads(out.stdout).items() if name != "admin"}


class AppWorldEnvironment:
    """AppWorld tasks from a data root (`data/tasks/`, `data/datasets/<split>.txt`), one server per process."""

    name = "appworld"
    max_concurrent_episodes: int | None = None  # in-process (one world per process: it runs behind the pool)

    def __init__(
        self,
        python: str,
        root: str,
        cell_timeout_s: int = 100,
        request_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        max_observation_chars: int = 32768,
    ):
        self.python, self.root = os.path.abspath(python), os.path.abspath(root)  # the server runs in root
        self.cell_timeout_s, self.request_timeout_s, self.start_timeout_s = (
            cell_timeout_s,
            request_timeout_s,
            start_timeout_s,
        )
        self.max_observation_chars = max_observation_chars
        self.live: AppWorldServer | None = None
        self.judge: AppWorldGrader | None = None
        appworld_scratch()  # room for the servers' sockets, checked before any server starts
        self.app_descriptions = app_descriptions(self.python, start_timeout_s)

    def tasks(self, split: str) -> list[Task]:
        path = Path(self.root) / "data" / "datasets" / f"{split}.txt"
        if not path.is_file():
            raise ValueError(f"no AppWorld split {split!r}: {path} is missing (splits: {', '.join(SPLITS)})")
        tasks = []
        for line in path.read_text().split():
            task_id = line.split(":")[0]  # AppWorld's dataset files may tag ids as "<id>:<tag>"
            metadata = json.loads(
                (Path(self.root) / "data" / "tasks" / task_id / "ground_truth" / "metadata.json").read_text()
            )
            tasks.append(Task(task_id, tier=metadata["difficulty"], scenario=task_id.split("_")[0]))
        return tasks

    def server(self) -> AppWorldServer:
        """The process's server, started (or restarted) when it is missing or unhealthy."""
        if self.live is not None and not self.live.healthy():
            self.discard_server()
        if self.live is None:
            self.live = AppWorldServer(self.python, self.root, self.start_timeout_s, self.request_timeout_s)
        return self.live

    def grader(self) -> AppWorldGrader:
        """The process's grader, started (or restarted) when it is missing or has exited."""
        if self.judge is not None and self.judge.process.poll() is not None:
            self.judge.stop()
            self.judge = None
        if self.judge is None:
            self.judge = AppWorldGrader(self.python, self.root, self.request_timeout_s)
        return self.judge

    def discard_server(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def start(self, task: Task, seed: int) -> AppWorldEpisode:
        return AppWorldEpisode(self, task, seed)

    def close(self) -> None:
        """Stop the process's AppWorld server and grader, if they run; the next episode starts them again."""
        self.discard_server()
        if self.judge is not None:
            self.judge.stop()
            self.judge = None


@dataclass
class AppWorldSettings:
    """`env.appworld.*` (conf/env/appworld.yaml): the keyword arguments of `AppWorldEnvironment`, the schema and the
    only defaults of those keys."""

    python: str | None = None  # the AppWorld venv's python (`make appworld`; conf/env/appworld.yaml: from
    # $CANOPY_APPWORLD_PYTHON, else .venv-appworld/bin/python)
    root: str | None = None  # holds data/ (`appworld download data`; conf/env/appworld.yaml: $APPWORLD_ROOT);
    # experiments/outputs/ is written below it
    cell_timeout_s: int = 100  # AppWorld's per-cell timeout: the agent's infinite loop becomes an error observation
    request_timeout_s: float = 60.0  # any other server request; past it the server is unresponsive (quarantine)
    start_timeout_s: float = 120.0
    max_observation_chars: int = 32768  # transport bound; budget.max_observation_tokens is the recipe's cap

    def validate(self, pool: PoolSettings) -> None:
        """The AppWorld venv, the data root, and timeouts nested inside the pool's: one line naming the fix on the
        first bad value."""

        require(
            pool.workers >= 1,
            f"env.pool.workers={pool.workers}: AppWorld holds one world per process, so it runs behind the pool; set "
            "env.pool.workers >= 1 (e.g. 64)",
        )
        require(
            self.python is not None and Path(self.python).is_file(),
            f"env.appworld.python '{self.python}' not found: run `make appworld` (or point env.appworld.python / "
            "CANOPY_APPWORLD_PYTHON at AppWorld's venv python)",
        )
        require(
            self.root is not None and (Path(self.root) / "data" / "tasks").is_dir(),
            f"env.appworld.root '{self.root}' has no data/tasks: download the data (`appworld download data --root "
            "DIR`, docs/environments.md) and pass env.appworld.root=DIR (or export APPWORLD_ROOT)",
        )
        for key in ("cell_timeout_s", "request_timeout_s", "start_timeout_s", "max_observation_chars"):
            require(getattr(self, key) > 0, f"env.appworld.{key}={getattr(self, key)} must be > 0")
        slowest = max(self.cell_timeout_s + 15, self.start_timeout_s) + self.request_timeout_s
        require(
            pool.request_timeout_s > slowest,
            f"env.pool.request_timeout_s={pool.request_timeout_s} must exceed {slowest} s (a step runs a cell, or a "
            "start boots a server, then one more AppWorld request), or the agent's slow code would be blamed on the "
            "worker",
        )


ENVIRONMENT, SETTINGS = AppWorldEnvironment, AppWorldSettings


def environment_kwargs(env) -> dict:
    """`env.appworld.*`, checked against the pool's settings: `AppWorldEnvironment`'s keyword arguments."""
    require(
        "appworld" in env, "env.appworld is missing: select AppWorld with env=appworld (a config group), not env.name"
    )
    settings = AppWorldSettings(**env.appworld)
    settings.validate(PoolSettings(**env.pool))
    return asdict(settings)
