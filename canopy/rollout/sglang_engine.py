"""The SGLang engine: LocalEngine's contract served by SGLang HTTP servers (GPU, their own venv; sglang >= 0.5.21).

Servers are launched with `python -m sglang.launch_server` from the SGLang venv's python, or attached by URL.
Each prompt is one `/generate` request (token ids in, `return_logprob`). Routing is sticky per episode: its first
turn goes to the healthy server with the fewest requests in flight, and its later turns follow, so its growing
prefix stays in that server's cache. A server that fails a request (connection error, 5xx) is ejected and
re-admitted once its /health answers; retries go to another server. With `router_url` the requests go to SGLang's
model gateway instead, the episode id in its `X-SMG-Routing-Key` header (the gateway's manual or consistent-hashing
policy keeps the episode on one server); weight sync and version checks still go to each server.

Returned logprobs: with SGLANG_RETURN_ORIGINAL_LOGPROB off (forced off for servers we launch), SGLang gives
log softmax(logits / temperature) over the whole vocabulary, before top-k / top-p, as LocalEngine does and as the
trainer scores (`token_logprobs` at the sampling temperature).

Weights reach every server after each optimizer step, then the servers report the new version:
- disk: safetensors shards + the base config / tokenizer streamed to <sync_dir>/v<version> (staged, renamed),
  then pause_generation -> update_weights_from_disk (which flushes the cache) -> continue_generation;
- distributed: trainer rank 0 joins the servers' process group once (init_weights_update_group), then
  pause -> begin_weight_update -> update_weights_from_distributed per bucket while broadcasting it -> end -> continue.
A request still failing after `max_retries` retries comes back as an `EngineFault` (the agent loop quarantines it).
"""

import atexit
import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from safetensors import safe_open

from canopy.errors import is_int, require
from canopy.modules.policy import write_hf_checkpoint
from canopy.rollout.engine import EngineFault, Generation, SamplingParams

GROUP_NAME = "canopy_weight_sync"
ROUTES_KEPT = 1 << 16  # sticky routes remembered
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # the gateway's session key (its manual / consistent_hashing policies)
TRANSIENT = (OSError, http.client.HTTPException, json.JSONDecodeError)  # connection refused / reset, timeouts, garbled


@dataclass
class SGLangSettings:
    """The `engine.sglang.*` keys (conf/train.yaml documents each)."""

    python: str | None = None
    urls: list[str] = field(default_factory=list)
    router_url: str | None = None
    num_servers: int = 1
    base_port: int = 30000
    host: str = "127.0.0.1"
    base_gpu_id: int = 0
    tp_size: int = 1
    mem_fraction: float = 0.8
    extra_args: list[str] = field(default_factory=list)
    weight_sync: str = "disk"
    sync_dir: str = ".cache/sglang"
    sync_master_addr: str = "127.0.0.1"
    sync_master_port: int = 29600
    sync_backend: str = "nccl"
    concurrency: int = 256
    request_timeout_s: float = 3600.0
    max_retries: int = 3
    startup_timeout_s: float = 900.0

    def validate(self, accelerator: str, trainer_devices: int = 1) -> None:
        """Launch (python) or attach (urls), ports, sizes, GPUs apart from the trainer's, weight sync reachable from
        the servers, and request limits: one line naming the fix on the first bad value."""

        urls = list(self.urls or [])
        require(
            bool(urls) or bool(self.python),
            "engine.sglang.python is not set: point it at the SGLang venv's python (or export CANOPY_SGLANG_PYTHON), "
            "or attach to running servers with engine.sglang.urls=[http://host:port]",
        )
        require(
            all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls),
            f"engine.sglang.urls={urls}: each must be a server URL like http://host:30000",
        )
        require(
            self.router_url is None or str(self.router_url).startswith(("http://", "https://")),
            f"engine.sglang.router_url={self.router_url}: must be null or the gateway's URL, like http://host:30080",
        )
        for key in ("num_servers", "tp_size", "concurrency", "base_port", "sync_master_port"):
            require(
                is_int(getattr(self, key)) and getattr(self, key) >= 1,
                f"engine.sglang.{key}={getattr(self, key)} must be a positive integer",
            )
        require(
            is_int(self.base_gpu_id) and self.base_gpu_id >= 0,
            f"engine.sglang.base_gpu_id={self.base_gpu_id} must be >= 0",
        )
        require(
            isinstance(self.mem_fraction, (int, float)) and 0 < self.mem_fraction < 1,
            f"engine.sglang.mem_fraction={self.mem_fraction} must lie in (0, 1), e.g. 0.8",
        )
        gpus = range(self.base_gpu_id, self.base_gpu_id + self.num_servers * self.tp_size)
        require(
            bool(urls) or accelerator == "cpu" or gpus.start >= trainer_devices,
            f"engine.sglang launches {self.num_servers} server(s) x tp {self.tp_size} on {gpu_names(gpus)}, but the "
            f"trainer uses {gpu_names(range(trainer_devices))} of that node (trainer.devices={trainer_devices}): "
            f"set engine.sglang.base_gpu_id={trainer_devices} (GPUs after the trainer's), or run "
            "the servers on other nodes and attach with engine.sglang.urls (colocation is not supported)",
        )
        remote = [u for u in urls if not is_loopback(u)]
        require(
            not (self.weight_sync == "distributed" and remote and is_loopback(f"//{self.sync_master_addr}")),
            f"engine.sglang.sync_master_addr={self.sync_master_addr} is a loopback address, but the servers "
            f"{remote} are on other machines and must reach the trainer's rank 0 there: set it to this node's "
            "address on their network",
        )
        require(
            self.weight_sync in ("disk", "distributed"),
            f"engine.sglang.weight_sync={self.weight_sync!r} is unknown: use disk or distributed",
        )
        require(
            self.sync_backend in ("nccl", "gloo"),
            f"engine.sglang.sync_backend={self.sync_backend!r} is unknown: use nccl or gloo",
        )
        require(
            not (self.weight_sync == "distributed" and self.sync_backend == "nccl" and accelerator == "cpu"),
            "engine.sglang.weight_sync=distributed over nccl broadcasts from the trainer's GPU: set "
            "trainer.accelerator=gpu, "
            "or use engine.sglang.weight_sync=disk",
        )
        require(self.sync_dir is not None, "engine.sglang.sync_dir is not set: give a directory the servers can read")
        for key in ("request_timeout_s", "startup_timeout_s"):
            require(
                isinstance(getattr(self, key), (int, float)) and getattr(self, key) > 0,
                f"engine.sglang.{key}={getattr(self, key)} must be > 0 seconds",
            )
        require(
            is_int(self.max_retries) and self.max_retries >= 0,
            f"engine.sglang.max_retries={self.max_retries} must be >= 0",
        )


def gpu_names(gpus: range) -> str:
    return f"GPU {gpus.start}" if len(gpus) == 1 else f"GPUs {gpus.start}-{gpus.stop - 1}"


def is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine only (localhost, 127.0.0.0/8, ::1)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


def client_host(bind: str) -> str:
    """Where this process reaches a server it launched bound to `bind` (a wildcard bind answers on loopback)."""
    return "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind


class StaleSampleError(RuntimeError):
    """A server returned a sample from weights other than the engine's current version (strict on-policy violated)."""


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class _Aborted(Exception):
    """The server aborted the request (finish_reason abort): worth another try."""


def _request(url: str, body: dict | None, timeout: float, headers: dict | None = None):
    """GET (no body) or POST JSON; returns the decoded JSON reply (or text). Raises _HTTPError on a non-2xx status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            text = reply.read().decode()
    except urllib.error.HTTPError as error:
        raise _HTTPError(error.code, error.read().decode(errors="replace")[:500]) from None
    return json.loads(text) if text.startswith(("{", "[")) else text


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str):
    """A process group beside the default one (which may be Lightning's), rendezvousing at `init_method` with keys
    prefixed by `group_name`: the trainer's end of the group each server builds in /init_weights_update_group."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(minutes=30)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_from_trainer(tensor: torch.Tensor, group) -> None:
    torch.distributed.broadcast(tensor, src=0, group=group)


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


def checkpoint_weight_names(path: Path) -> set[str]:
    names = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            names.update(f.keys())
    if not names:
        raise FileNotFoundError(f"model.path '{path}' has no *.safetensors weights: point it at an HF checkpoint dir")
    return names


def checkpoint_dtype(path: Path) -> torch.dtype | None:
    """The dtype config.json declares (weights are synced in it), or None to keep the trainer's."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) else None


def serving_dtype(extra_args: list[str], model_path: str | Path) -> str:
    """The dtype SGLang computes in: `--dtype` when given, else its "auto" rule on the checkpoint's config.json
    (a float32 checkpoint is served in float16, one that declares none in bfloat16). The audit's gap bounds are
    chosen by it."""
    args = list(extra_args)
    given = args[args.index("--dtype") + 1] if "--dtype" in args[:-1] else "auto"
    if given != "auto":
        return {"half": "float16", "float": "float32"}.get(given, given)
    declared = checkpoint_dtype(Path(model_path))
    if declared is None:
        return "bfloat16"
    return "float16" if declared == torch.float32 else str(declared).removeprefix("torch.")


@dataclass(eq=False)
class _Server:
    url: str
    tp_size: int
    process: subprocess.Popen | None = None
    log: Path | None = None
    outstanding: int = 0
    ejected: bool = False  # failed a request: takes none until its health check answers again


class SGLangEngine:
    """Generates over SGLang servers; weights pushed after every step, each sample checked for the current version."""

    def __init__(
        self,
        model_path: str | Path,
        stop_token_ids: list[int],
        settings: SGLangSettings,
        *,
        context_length: int | None = None,
        rope_scaling: dict | None = None,
        seed: int = 0,
        retry_backoff_s: float = 1.0,
        health_interval_s: float = 5.0,
        shard_bytes: int = 4 << 30,
        bucket_bytes: int = 1 << 30,
        init_group: Callable = init_custom_process_group,
        broadcast: Callable = broadcast_from_trainer,
    ):
        self.model_path = Path(model_path).resolve()
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.settings = settings
        self.context_length, self.rope_scaling, self.seed = context_length, rope_scaling, seed
        self.weight_version = 0
        self.weight_names = checkpoint_weight_names(self.model_path)
        self.sync_dtype = checkpoint_dtype(self.model_path)
        self.dtype = serving_dtype(settings.extra_args, self.model_path)
        self.sync_dir = Path(settings.sync_dir).resolve()
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.retry_backoff_s, self.shard_bytes, self.bucket_bytes = retry_backoff_s, shard_bytes, bucket_bytes
        self.init_group, self.broadcast, self.group = init_group, broadcast, None
        self.lock = threading.Lock()
        self.servers: list[_Server] = []  # every server: control traffic (weight sync, versions) goes to each
        # SGLang's model gateway, when given: the data plane (/generate), pinned per episode by its routing key
        self.router = _Server(settings.router_url.rstrip("/"), 0) if settings.router_url else None
        # episode key -> (its server, the server of its first turn): sticky routing, least recently used dropped first
        self.routes: OrderedDict[str, tuple[_Server, _Server]] = OrderedDict()
        self.routing = Counter()  # turns, on_first_server, ejections, readmissions
        self.watcher: threading.Thread | None = None
        self.closing = False
        self.health_interval_s = health_interval_s
        atexit.register(self.close)
        try:
            if settings.urls:
                self.servers = [_Server(url.rstrip("/"), settings.tp_size) for url in settings.urls]
            for i in range(0 if settings.urls else settings.num_servers):  # all start, then all are waited for
                self.servers.append(self._launch(i, context_length, rope_scaling, seed))
            for server in self.servers:
                self._wait_healthy(server)
            if settings.urls:  # an attached server may hold any weights: start from the base at version 0
                self._for_all("/update_weights_from_disk", {"model_path": str(self.model_path), "weight_version": "0"})
            self._verify_version("0")
        except BaseException:
            self.close()
            raise
        self.pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="sglang-request")

    # ---- servers -------------------------------------------------------------------------------------------------

    def _launch(self, index: int, context_length: int | None, rope_scaling: dict | None, seed: int) -> _Server:
        if not self.settings.python:
            raise ValueError(
                "engine.sglang.python is not set: point it at the SGLang venv's python (or export "
                "CANOPY_SGLANG_PYTHON), or attach to running servers with engine.sglang.urls"
            )
        argv, env = launch_command(self.settings, self.model_path, index, context_length, rope_scaling, seed)
        port = self.settings.base_port + index
        log = self.sync_dir / f"server_{port}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
            )
        return _Server(f"http://{client_host(self.settings.host)}:{port}", self.settings.tp_size, process, log)

    def _wait_healthy(self, server: _Server) -> None:
        """Poll /health_generate (one real token) until it answers 200; a dead process or the timeout raises."""
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while True:
            if server.process is not None and server.process.poll() is not None:
                raise RuntimeError(self._startup_error(server, f"exited with code {server.process.returncode}"))
            try:
                _request(server.url + "/health_generate", None, timeout=60)
                return
            except (_HTTPError, *TRANSIENT):
                pass
            if time.monotonic() > deadline:
                what = f"was not healthy after {self.settings.startup_timeout_s:.0f} s"
                raise RuntimeError(self._startup_error(server, what))
            time.sleep(1.0)

    def _startup_error(self, server: _Server, what: str) -> str:
        if server.log is None:
            return f"SGLang server {server.url} {what}: check that it runs, or fix engine.sglang.urls"
        tail = "\n".join(server.log.read_text(errors="replace").splitlines()[-30:])
        return f"SGLang server {server.url} {what}: fix the launch (engine.sglang.*) from its log {server.log}:\n{tail}"

    def at_budget(self, context_length: int, rope_scaling: dict | None) -> "SGLangEngine | None":
        """Itself when its servers run with this RoPE scaling and at least this context; else None: the servers
        would need a relaunch (`relaunched`), which only the end of training can afford."""
        fits = self.context_length is None or context_length <= self.context_length
        return self if fits and (rope_scaling or None) == (self.rope_scaling or None) else None

    @property
    def can_relaunch(self) -> bool:
        """Whether this engine launched its servers (attached ones belong to someone else: never relaunched)."""
        return not self.settings.urls

    @contextlib.contextmanager
    def relaunched(self, context_length: int, rope_scaling: dict | None):
        """Inside the block, the servers run relaunched on the same ports and GPUs with this context length and
        RoPE scaling, from the base weights at version 0 (push the policy's weights next); afterwards they are
        relaunched with the training settings, again at the base weights (push them again)."""
        if not self.can_relaunch:
            raise RuntimeError("attached SGLang servers (engine.sglang.urls) are never relaunched by Canopy")
        training = (self.context_length, self.rope_scaling)
        try:
            self._relaunch(context_length, rope_scaling)
            yield self
        finally:
            self._relaunch(*training)

    def _relaunch(self, context_length: int | None, rope_scaling: dict | None) -> None:
        self._stop_servers()
        self.servers = [self._launch(i, context_length, rope_scaling, self.seed) for i in range(len(self.servers))]
        for server in self.servers:
            self._wait_healthy(server)
        self._verify_version("0")
        self.context_length, self.rope_scaling, self.weight_version = context_length, rope_scaling, 0

    def evaluation_seed(self, seed: int):
        """SGLang's sampling state lives in the servers and is per request: nothing to save or restore."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Stop the servers this engine launched (their whole process groups)."""
        self.closing = True
        self._stop_servers()
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _stop_servers(self) -> None:
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

    # ---- generation ----------------------------------------------------------------------------------------------

    concurrent = True  # serves each episode's request as it comes (`run_episodes` sends them one by one)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        sampling: SamplingParams,
        keys: list[str | None] | None = None,
    ) -> list[Generation | EngineFault]:
        """One concurrent request per prompt; `keys` (one per prompt: its episode) make routing sticky. A request that
        fails on every try comes back as an `EngineFault` in its slot; a stale sample or a request the server rejects
        as invalid raises."""
        keys = keys or [None] * len(prompts)
        futures = [
            self.pool.submit(self._generate_one, p, n, sampling, key)
            for p, n, key in zip(prompts, max_new_tokens, keys)
        ]
        return [future.result() for future in futures]

    def release(self, keys: Iterable[str]) -> None:
        """These episodes ended: forget their routes."""
        with self.lock:
            for key in keys:
                self.routes.pop(key, None)

    def request_body(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams) -> dict:
        return {
            "input_ids": list(prompt),
            "sampling_params": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "max_new_tokens": max_new_tokens,
                "stop_token_ids": self.stop_token_ids,
                "skip_special_tokens": False,
                "no_stop_trim": True,
            },
            "return_logprob": True,
        }

    def _generate_one(
        self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, key: str | None = None
    ) -> Generation | EngineFault:
        if max_new_tokens <= 0:
            return Generation([], [], "length", self.weight_version)
        body = self.request_body(prompt, max_new_tokens, sampling)
        failed, error = None, None
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * attempt)
            server = self._acquire(avoid=failed, key=key)
            headers = {ROUTING_KEY_HEADER: key} if server is self.router and key is not None else None
            try:
                return self.parse(_request(server.url + "/generate", body, self.settings.request_timeout_s, headers))
            except _HTTPError as e:
                if e.status < 500 and e.status not in (408, 429):
                    raise RuntimeError(
                        f"SGLang {server.url} rejected a /generate request: {e}; "
                        "check the budget against the server's --context-length"
                    ) from None
                failed, error = server, e
                if e.status >= 500:
                    self._eject(server)
            except _Aborted as e:  # the server chose to abort (a weight sync pauses it): not a sick server
                failed, error = server, e
            except TRANSIENT as e:
                failed, error = server, e
                self._eject(server)
            finally:
                self._release(server)
        return EngineFault("engine_request_failed", f"{attempt + 1} tries, last on {failed.url}: {error!r}")

    def parse(self, reply: dict) -> Generation:
        """A /generate reply -> Generation; the sample must come from the engine's current weight version."""
        meta = reply["meta_info"]
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort":
            raise _Aborted(finish.get("message", "aborted"))
        if finish.get("type") not in ("stop", "length"):
            raise RuntimeError(f"SGLang finished a request with {finish!r}: expected stop or length")
        versions = {span["version"] for span in meta.get("weight_versions", [])} | {meta.get("weight_version")}
        if versions != {str(self.weight_version)}:
            raise StaleSampleError(
                f"SGLang sampled with weight version(s) {sorted(map(str, versions))} but the engine holds "
                f"{self.weight_version}: a server missed a weight sync; restart it or re-sync"
            )
        logprobs = meta["output_token_logprobs"]  # [[logprob, token id, text or null], ...]
        ids, values = [int(t) for _, t, _ in logprobs], [float(lp) for lp, _, _ in logprobs]
        return Generation(ids, values, finish["type"], self.weight_version)

    def _acquire(self, avoid: _Server | None, key: str | None = None) -> _Server:
        """The episode's server (`key`), sticky from its first turn so that its prefix stays in that server's cache;
        on a first turn, or when its server is ejected or just failed (`avoid`), the healthy server with the fewest
        requests in flight, which the episode then keeps. Ejected servers take requests only when none is healthy.
        With a gateway (`router_url`) every request goes to it, and it keeps the episode on one server."""
        with self.lock:
            if self.router is not None:
                self.router.outstanding += 1
                self.routing["turns"] += key is not None
                return self.router
            healthy = [s for s in self.servers if not s.ejected and s is not avoid]
            candidates = healthy or [s for s in self.servers if s is not avoid] or self.servers
            server, first = self.routes.pop(key, (None, None))
            if server not in candidates:
                server = min(candidates, key=lambda s: s.outstanding)
            if key is not None:
                self.routes[key] = (server, first or server)  # (re)inserted last: the most recently used
                while len(self.routes) > ROUTES_KEPT:
                    self.routes.popitem(last=False)
                self.routing["turns"] += 1
                self.routing["on_first_server"] += server is (first or server)
            server.outstanding += 1
            return server

    def _eject(self, server: _Server) -> None:
        """Take a failing server out of routing; the health watcher re-admits it once /health answers and it serves the
        engine's weight version. The gateway
        is never ejected: it routes around its own failing servers, and its requests are retried like any other."""
        with self.lock:
            if server.ejected or server is self.router:
                return
            server.ejected = True
            self.routing["ejections"] += 1
            if self.watcher is None or not self.watcher.is_alive():
                self.watcher = threading.Thread(target=self._watch_ejected, name="sglang-health", daemon=True)
                self.watcher.start()

    def _watch_ejected(self) -> None:
        while not self.closing:
            with self.lock:
                ejected = [s for s in self.servers if s.ejected]
            if not ejected:
                return
            time.sleep(self.health_interval_s)
            for server in ejected:
                try:  # healthy, and serving the engine's weights (a restarted server holds others until re-synced)
                    _request(server.url + "/health", None, timeout=5)
                    info = _request(server.url + "/model_info", None, timeout=5)
                except (_HTTPError, *TRANSIENT):
                    continue
                if str(info.get("weight_version")) != str(self.weight_version):
                    continue
                with self.lock:
                    server.ejected = False
                    self.routing["readmissions"] += 1

    def _release(self, server: _Server) -> None:
        with self.lock:
            server.outstanding -= 1

    # ---- weight sync ---------------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push the trainer's (HF name, tensor) stream to every server; later samples must carry `version`.
        Every weight of the base checkpoint must come, and nothing else: a partial update would mix two policies."""
        if self.settings.weight_sync == "disk":
            path = write_hf_checkpoint(
                self._checked(named_tensors, version),
                self.model_path,
                self.sync_dir / f"v{version}",
                self.sync_dtype,
                self.shard_bytes,
            )
            self._for_all("/pause_generation", {"mode": "abort"})
            # flush_cache: no KV computed by the old weights survives, and the update fails if the cache cannot be
            # flushed (requests still running); SGLang's default, stated
            body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
            self._for_all("/update_weights_from_disk", body)
            self._for_all("/continue_generation", {})
        else:
            self._sync_distributed(self._checked(named_tensors, version), version)
        self._verify_version(str(version))
        self.weight_version = version
        if self.settings.weight_sync == "disk":
            for old in self.sync_dir.glob("v*"):
                if old.is_dir() and old.name != f"v{version}":
                    shutil.rmtree(old)

    def _checked(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        missing = set(self.weight_names)
        for name, tensor in named_tensors:
            if name not in self.weight_names:
                raise KeyError(f"weight update names {name!r}, which the engine's model does not have")
            missing.discard(name)
            yield name, tensor
        if missing:
            raise RuntimeError(
                f"weight update to version {version} missed {sorted(missing)[:3]}: engine weights would be mixed"
            )

    def _sync_distributed(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        if self.group is None:
            self.group = self._init_group()
        self._for_all("/pause_generation", {"mode": "abort"})
        self._for_all("/begin_weight_update", {})
        pending = None  # one bucket held back, so the last one can carry the new weight_version
        for bucket in self._buckets(named_tensors):
            if pending is not None:
                self._send_bucket(pending, None)
            pending = bucket
        if pending is not None:
            self._send_bucket(pending, str(version))
        self._for_all("/end_weight_update", {})
        self._for_all("/continue_generation", {})

    def _init_group(self):
        """Trainer rank 0 plus every server's TP ranks (rank offsets counted from 1), formed concurrently."""
        s = self.settings
        offsets = [1 + sum(server.tp_size for server in self.servers[:i]) for i in range(len(self.servers))]
        world_size = 1 + sum(server.tp_size for server in self.servers)
        with ThreadPoolExecutor(len(self.servers)) as requests:
            replies = [
                requests.submit(
                    self._control,
                    server,
                    "/init_weights_update_group",
                    {
                        "master_address": s.sync_master_addr,
                        "master_port": s.sync_master_port,
                        "rank_offset": offset,
                        "world_size": world_size,
                        "group_name": GROUP_NAME,
                        "backend": s.sync_backend,
                    },
                )
                for server, offset in zip(self.servers, offsets)
            ]
            init_method = f"tcp://{s.sync_master_addr}:{s.sync_master_port}"
            group = self.init_group(s.sync_backend, init_method, world_size, 0, GROUP_NAME)
            for reply in replies:
                reply.result()
        return group

    def _buckets(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        device = "cuda" if self.settings.sync_backend == "nccl" else "cpu"
        bucket, size = [], 0
        for name, tensor in named_tensors:
            bucket.append((name, tensor.detach().to(device, self.sync_dtype or tensor.dtype).contiguous()))
            size += bucket[-1][1].nbytes
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        """Every server posts the bucket's metadata, then receives its tensors as the trainer broadcasts them."""
        body = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": GROUP_NAME,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        with ThreadPoolExecutor(len(self.servers)) as requests:
            path = "/update_weights_from_distributed"
            replies = [requests.submit(self._control, server, path, body) for server in self.servers]
            for _, tensor in bucket:
                self.broadcast(tensor, self.group)
            for reply in replies:
                reply.result()

    # ---- control calls -------------------------------------------------------------------------------------------

    def _control(self, server: _Server, path: str, body: dict | None = None):
        try:
            reply = _request(server.url + path, body, self.settings.request_timeout_s)
        except (_HTTPError, *TRANSIENT) as error:
            raise RuntimeError(f"SGLang {server.url}{path} failed: {error}; see the server's log") from None
        if isinstance(reply, dict) and reply.get("success") is False:
            raise RuntimeError(f"SGLang {server.url}{path} failed: {reply.get('message')}; see the server's log")
        return reply

    def _for_all(self, path: str, body: dict | None = None) -> list:
        with ThreadPoolExecutor(len(self.servers)) as requests:
            return list(requests.map(lambda server: self._control(server, path, body), self.servers))

    def _verify_version(self, version: str) -> None:
        for server, info in zip(self.servers, self._for_all("/model_info")):
            if str(info.get("weight_version")) != version:
                raise RuntimeError(
                    f"SGLang {server.url} serves weight version {info.get('weight_version')!r}, expected {version!r}: "
                    "the weight update did not take; see the server's log"
                )
