"""The servers of an HTTP engine: launched by its backend's command (each logging to <sync_dir>/server_<port>.log,
in a process group of its own) or attached by URL, waited for until they can generate, relaunched with other context
settings, stopped; and the control calls to them. Control calls (weight sync, version checks) go to every server,
which must then all serve one weight version."""

import contextlib
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from canopy.rollout.engine import Generation, SamplingParams
from canopy.rollout.http.client import TRANSIENT, HTTPError, client_host, request


class ServerSettings(Protocol):
    """The keys every backend's settings have (`engine.<backend>.*`): see `SGLangSettings`, `VLLMSettings`."""

    python: str | None
    urls: list[str]
    num_servers: int
    base_port: int
    host: str
    sync_dir: str
    concurrency: int
    request_timeout_s: float
    max_retries: int
    startup_timeout_s: float


class ServerBackend(Protocol):
    """What one serving stack provides, the rest being shared (`canopy.rollout.sglang.SGLang`,
    `canopy.rollout.vllm.VLLM`). Like verl's `BaseRollout`, it declares what its servers can do."""

    name: str  # in messages: "SGLang", "vLLM"
    key: str  # its settings' config key, in messages: "engine.sglang"
    ready_path: str  # GET: 200 once a launched server can generate
    generate_path: str  # POST: one completion
    version_path: str  # GET: {"weight_version": ...}
    routing_header: str | None  # the header a gateway in front of the servers keys its sessions by (None: none)

    def launch_command(
        self, index: int, context_length: int | None, rope_scaling: dict | None, seed: int
    ) -> tuple[list[str], dict[str, str]]:
        """argv and extra environment of the `index`-th server it launches."""

    def start_version(self, fleet: "Fleet") -> None:
        """Bring every server (just launched, or attached holding any weights) to the base weights at version 0."""

    def request_body(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams) -> dict:
        """The generate request of one prompt (token ids in)."""

    def parse(self, reply: dict, version: int) -> Generation:
        """The reply -> Generation; raises `Aborted` (worth another try) or `StaleSampleError` (not from `version`)."""


@dataclass(eq=False)
class Server:
    url: str
    tp_size: int = 1
    index: int | None = None  # launched: its place in the fleet (port base_port + index)
    process: subprocess.Popen | None = None
    log: Path | None = None
    outstanding: int = 0
    ejected: bool = False  # failed a request: takes none until its health check answers again
    stopped: bool = False  # stopped on purpose (relaunch, close): never revived, whatever a health check saw


class Fleet:
    """Every server of an engine, and the weight version all of them were last verified to serve."""

    def __init__(self, settings: ServerSettings, backend: ServerBackend, log_dir: Path, tp_size: int = 1):
        self.settings, self.backend, self.log_dir, self.tp_size = settings, backend, log_dir, tp_size
        self.servers: list[Server] = []
        self.weight_version = 0
        self.launch_settings: tuple[int | None, dict | None, int] | None = None  # context, RoPE scaling, seed

    def start(self, context_length: int | None, rope_scaling: dict | None, seed: int) -> None:
        """Attach to `urls` or launch `num_servers`; all start, then all are waited for, then each must serve the base
        weights at version 0."""
        s = self.settings
        self.launch_settings = (context_length, rope_scaling, seed)
        if s.urls:
            self.servers = [Server(url.rstrip("/"), self.tp_size) for url in s.urls]
        self.servers += [self._launch(i) for i in range(0 if s.urls else s.num_servers)]
        self._ready_at_base_weights()

    def relaunch(self, context_length: int | None, rope_scaling: dict | None, seed: int) -> None:
        """Stop the launched servers and launch as many on the same ports and GPUs, from the base weights."""
        self.stop()
        self.launch_settings = (context_length, rope_scaling, seed)
        self.servers = [self._launch(i) for i in range(len(self.servers))]
        self._ready_at_base_weights()

    def _ready_at_base_weights(self) -> None:
        """Every server waited for, brought to the base weights at version 0, and checked to report it."""
        with ThreadPoolExecutor(len(self.servers)) as waits:
            list(waits.map(self.wait_ready, self.servers))
        self.backend.start_version(self)
        self.verify_version(0)

    def _launch(self, index: int) -> Server:
        """The `index`-th server, launched with the fleet's launch settings (context, RoPE scaling, seed)."""
        b, s = self.backend, self.settings
        if not s.python:
            raise ValueError(
                f"{b.key}.python is not set: point it at the {b.name} venv's python, or attach to running servers "
                f"with {b.key}.urls"
            )
        argv, env = b.launch_command(index, *self.launch_settings)
        port = s.base_port + index
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"server_{port}.log"
        scratch = self.log_dir / "tmp" / f"server_{port}"  # its temporary files (vLLM's gloo rendezvous file, ...):
        shutil.rmtree(scratch, ignore_errors=True)  # here, emptied at each launch, and never left in /tmp
        scratch.mkdir(parents=True)
        env = {**os.environ, "TMPDIR": str(scratch), **env}
        with open(log, "wb") as out:  # a session of its own: stop() ends the server's whole process group
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return Server(f"http://{client_host(s.host)}:{port}", self.tp_size, index, process, log)

    def revive(self, server: Server) -> bool:
        """Launch again, on its port, a launched server whose process has exited, and wait until it is ready (it holds
        the base weights). False when it is not such a server (never launched, or stopped on purpose: a relaunch's
        old server seen dead by a health check that began before it), or its relaunch failed (tried again later)."""
        if server.process is None or server.stopped or server.process.poll() is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)  # what is left of its group (engine, workers)
        if server.log is not None and server.log.exists():  # the dead server's log is kept beside the new one's
            server.log.rename(server.log.with_suffix(f".exit{server.process.returncode}-{time.time():.0f}.log"))
        fresh = self._launch(server.index)
        server.process, server.log = fresh.process, fresh.log
        try:
            self.wait_ready(server)
        except RuntimeError:
            return False
        return True

    def wait_ready(self, server: Server) -> None:
        """Poll the backend's ready route until it answers 200; a dead process or the timeout raises."""
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while True:
            if server.process is not None and server.process.poll() is not None:
                raise RuntimeError(self._startup_error(server, f"exited with code {server.process.returncode}"))
            try:
                request(server.url + self.backend.ready_path, None, timeout=60)
                return
            except (HTTPError, *TRANSIENT):
                pass
            if time.monotonic() > deadline:
                what = f"was not healthy after {self.settings.startup_timeout_s:.0f} s"
                raise RuntimeError(self._startup_error(server, what))
            time.sleep(0.5)

    def _startup_error(self, server: Server, what: str) -> str:
        b = self.backend
        if server.log is None:
            return f"{b.name} server {server.url} {what}: check that it runs, or fix {b.key}.urls"
        tail = "\n".join(server.log.read_text(errors="replace").splitlines()[-30:])
        return f"{b.name} server {server.url} {what}: fix the launch ({b.key}.*) from its log {server.log}:\n{tail}"

    def stop(self) -> None:
        """Stop the servers this fleet launched (their whole process groups); attached ones are left running."""
        for server in self.servers:
            process = server.process
            if process is None:
                continue
            server.stopped = True  # before it dies: a health check that sees it dead must not launch it again
            try:
                os.killpg(process.pid, signal.SIGTERM)  # the group: a server's engine and workers outlive its parent
                process.wait(timeout=30)
            except ProcessLookupError:
                continue
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def control(self, server: Server, path: str, body: dict | None = None, method: str | None = None):
        """One control call; a failure (or a reply saying `success: false`) raises, pointing at the server's log."""
        name = self.backend.name
        try:
            reply = request(server.url + path, body, self.settings.request_timeout_s, method=method)
        except (HTTPError, *TRANSIENT) as error:
            raise RuntimeError(f"{name} {server.url}{path} failed: {error}; see the server's log") from None
        if isinstance(reply, dict) and reply.get("success") is False:
            raise RuntimeError(f"{name} {server.url}{path} failed: {reply.get('message')}; see the server's log")
        return reply

    def for_all(self, path: str, body: dict | None = None, method: str | None = None, servers=None) -> list:
        """The same control call to every server (or to `servers`) at once; their replies in server order."""
        servers = self.servers if servers is None else servers
        with ThreadPoolExecutor(max(1, len(servers))) as requests:
            return list(requests.map(lambda server: self.control(server, path, body, method), servers))

    def served_version(self, server: Server, timeout: float | None = None) -> str:
        reply = request(server.url + self.backend.version_path, None, timeout or self.settings.request_timeout_s)
        return str(reply.get("weight_version"))

    def live(self) -> list[Server]:
        """The servers not ejected."""
        return [server for server in self.servers if not server.ejected]

    def verify_version(self, version: int, servers=None) -> None:
        """Every server (or each of `servers`) must report `version`, which then becomes the fleet's weight version."""
        expected = str(version)
        for server in self.servers if servers is None else servers:
            try:
                served = self.served_version(server)
            except (HTTPError, *TRANSIENT) as error:
                raise RuntimeError(f"{self.backend.name} {server.url}: no weight version ({error})") from None
            if served != expected:
                raise RuntimeError(
                    f"{self.backend.name} {server.url} serves weight version {served!r}, expected {expected!r}: "
                    "the weight update did not take; see the server's log"
                )
        self.weight_version = version
