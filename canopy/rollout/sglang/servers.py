"""The SGLang servers of an engine: launched with `python -m sglang.launch_server` from the SGLang venv's python
(each logging to <sync_dir>/server_<port>.log) or attached by URL, waited for until /health_generate answers,
relaunched with other context settings, stopped; and the HTTP calls to them. Control calls (weight sync, version
checks) go to every server, which must then all serve one weight version."""

import http.client
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from canopy.rollout.sglang.settings import SGLangSettings

TRANSIENT = (OSError, http.client.HTTPException, json.JSONDecodeError)  # connection refused / reset, timeouts, garbled


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def request(url: str, body: dict | None, timeout: float, headers: dict | None = None):
    """GET (no body) or POST JSON; returns the decoded JSON reply (or text). Raises HTTPError on a non-2xx status."""
    data = None if body is None else json.dumps(body).encode()
    outgoing = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(outgoing, timeout=timeout) as reply:
            text = reply.read().decode()
    except urllib.error.HTTPError as error:
        raise HTTPError(error.code, error.read().decode(errors="replace")[:500]) from None
    return json.loads(text) if text.startswith(("{", "[")) else text


def client_host(bind: str) -> str:
    """Where this process reaches a server it launched bound to `bind` (a wildcard bind answers on loopback)."""
    return "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind


def launch_command(
    settings: SGLangSettings,
    model_path: str | Path,
    index: int,
    context_length: int | None,
    rope_scaling: dict | None,
    seed: int,
) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment of the `index`-th server (port and GPUs counted up from the base ones)."""
    s = settings
    argv = [
        s.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        s.host,
        "--port",
        str(s.base_port + index),
        "--tp-size",
        str(s.tp_size),
        "--base-gpu-id",
        str(s.base_gpu_id + index * s.tp_size),
        "--mem-fraction-static",
        str(s.mem_fraction),
        "--weight-version",
        "0",
        "--random-seed",
        str(seed + index),
    ]
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}  # logprobs of the temperature-scaled distribution
    if context_length is not None:
        argv += ["--context-length", str(context_length)]
    if rope_scaling:  # YaRN past the native context (enlarged budget)
        argv += ["--json-model-override-args", json.dumps({"rope_scaling": dict(rope_scaling)})]
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    return argv + list(s.extra_args), env


@dataclass(eq=False)
class Server:
    url: str
    tp_size: int
    process: subprocess.Popen | None = None
    log: Path | None = None
    outstanding: int = 0
    ejected: bool = False  # failed a request: takes none until its health check answers again


class Fleet:
    """Every server of an engine, and the weight version all of them were last verified to serve."""

    def __init__(self, settings: SGLangSettings, model_path: Path, log_dir: Path):
        self.settings, self.model_path, self.log_dir = settings, model_path, log_dir
        self.servers: list[Server] = []
        self.weight_version = 0

    def start(self, context_length: int | None, rope_scaling: dict | None, seed: int) -> None:
        """Attach to `urls` (reset to the base weights) or launch `num_servers`; all start, then all are waited for,
        then each must serve version 0."""
        s = self.settings
        if s.urls:
            self.servers = [Server(url.rstrip("/"), s.tp_size) for url in s.urls]
        for i in range(0 if s.urls else s.num_servers):
            self.servers.append(self._launch(i, context_length, rope_scaling, seed))
        for server in self.servers:
            self._wait_healthy(server)
        if s.urls:  # an attached server may hold any weights: start from the base at version 0
            self.for_all("/update_weights_from_disk", {"model_path": str(self.model_path), "weight_version": "0"})
        self.verify_version(0)

    def relaunch(self, context_length: int | None, rope_scaling: dict | None, seed: int) -> None:
        """Stop the launched servers and launch as many on the same ports and GPUs, from the base weights."""
        self.stop()
        self.servers = [self._launch(i, context_length, rope_scaling, seed) for i in range(len(self.servers))]
        for server in self.servers:
            self._wait_healthy(server)
        self.verify_version(0)

    def _launch(self, index: int, context_length: int | None, rope_scaling: dict | None, seed: int) -> Server:
        if not self.settings.python:
            raise ValueError(
                "engine.sglang.python is not set: point it at the SGLang venv's python (or export "
                "CANOPY_SGLANG_PYTHON), or attach to running servers with engine.sglang.urls"
            )
        argv, env = launch_command(self.settings, self.model_path, index, context_length, rope_scaling, seed)
        port = self.settings.base_port + index
        log = self.log_dir / f"server_{port}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
            )
        return Server(f"http://{client_host(self.settings.host)}:{port}", self.settings.tp_size, process, log)

    def _wait_healthy(self, server: Server) -> None:
        """Poll /health_generate (one real token) until it answers 200; a dead process or the timeout raises."""
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while True:
            if server.process is not None and server.process.poll() is not None:
                raise RuntimeError(self._startup_error(server, f"exited with code {server.process.returncode}"))
            try:
                request(server.url + "/health_generate", None, timeout=60)
                return
            except (HTTPError, *TRANSIENT):
                pass
            if time.monotonic() > deadline:
                what = f"was not healthy after {self.settings.startup_timeout_s:.0f} s"
                raise RuntimeError(self._startup_error(server, what))
            time.sleep(1.0)

    def _startup_error(self, server: Server, what: str) -> str:
        if server.log is None:
            return f"SGLang server {server.url} {what}: check that it runs, or fix engine.sglang.urls"
        tail = "\n".join(server.log.read_text(errors="replace").splitlines()[-30:])
        return f"SGLang server {server.url} {what}: fix the launch (engine.sglang.*) from its log {server.log}:\n{tail}"

    def stop(self) -> None:
        """Stop the servers this fleet launched (their whole process groups); attached ones are left running."""
        for server in self.servers:
            process = server.process
            if process is None or process.poll() is not None:
                continue
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def control(self, server: Server, path: str, body: dict | None = None):
        """One control call; a failure (or a reply saying `success: false`) raises, pointing at the server's log."""
        try:
            reply = request(server.url + path, body, self.settings.request_timeout_s)
        except (HTTPError, *TRANSIENT) as error:
            raise RuntimeError(f"SGLang {server.url}{path} failed: {error}; see the server's log") from None
        if isinstance(reply, dict) and reply.get("success") is False:
            raise RuntimeError(f"SGLang {server.url}{path} failed: {reply.get('message')}; see the server's log")
        return reply

    def for_all(self, path: str, body: dict | None = None) -> list:
        """The same control call to every server at once; their replies in server order."""
        with ThreadPoolExecutor(len(self.servers)) as requests:
            return list(requests.map(lambda server: self.control(server, path, body), self.servers))

    def verify_version(self, version: int) -> None:
        """Every server must report `version` (/model_info), which then becomes the fleet's weight version."""
        expected = str(version)
        for server, info in zip(self.servers, self.for_all("/model_info")):
            if str(info.get("weight_version")) != expected:
                raise RuntimeError(
                    f"SGLang {server.url} serves weight version {info.get('weight_version')!r}, expected {expected!r}: "
                    "the weight update did not take; see the server's log"
                )
        self.weight_version = version
