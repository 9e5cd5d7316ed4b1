"""`HTTPEngine`: the `Engine` contract served by a fleet of inference servers over HTTP, whatever their backend.

Each prompt is one generate request (token ids in, logprobs out), routed per episode (`routing`) to the servers the
engine launched or attached (`fleet`); the backend's weight sync reaches every server after each optimizer step, and
each sample must carry the version it set.
"""

import atexit
import contextlib
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Protocol

import torch

from canopy.rollout.engine import EngineFault, Generation, SamplingParams
from canopy.rollout.http.fleet import Fleet, Server
from canopy.rollout.http.routing import Router


class WeightSync(Protocol):
    """How a backend's servers take the trainer's weights."""

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Every live server must serve `version` afterwards (verified), or this raises."""


class HTTPEngine:
    """Generates over the servers of `fleet`; weights pushed after every step by `weight_sync`, each sample checked
    for the current version. A backend's engine builds the three parts and hands them over."""

    dtype: str
    concurrent = True  # serves each episode's request as it comes (`run_episodes` sends them one by one)
    counters: Mapping[str, int] = MappingProxyType({})  # what the servers compute is counted by them, not here

    def __init__(
        self,
        fleet: Fleet,
        router: Router,
        weight_sync: WeightSync,
        dtype: str,
        *,
        context_length: int | None,
        rope_scaling: dict | None,
        seed: int,
    ):
        self.fleet, self.router, self.weight_sync, self.dtype = fleet, router, weight_sync, dtype
        self.backend, self.settings = fleet.backend, fleet.settings
        self.context_length, self.rope_scaling, self.seed = context_length, rope_scaling, seed
        self.sync_lock = threading.Lock()  # a weight sync and a recovered server's re-sync never interleave
        self.pool: ThreadPoolExecutor | None = None  # the request threads, once the servers are up
        atexit.register(self.close)
        try:
            self.fleet.start(context_length, rope_scaling, seed)
        except BaseException:
            self.close()
            raise
        self.pool = ThreadPoolExecutor(self.settings.concurrency, thread_name_prefix="engine-request")

    @property
    def weight_version(self) -> int:
        """The version every server was last verified to serve: each sample must carry it."""
        return self.fleet.weight_version

    # ---- servers -------------------------------------------------------------------------------------------------

    def at_budget(self, context_length: int, rope_scaling: dict | None) -> "HTTPEngine | None":
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
            raise RuntimeError(
                f"attached {self.backend.name} servers ({self.backend.key}.urls) are never relaunched by Canopy"
            )
        training = (self.context_length, self.rope_scaling)
        try:
            self._relaunch(context_length, rope_scaling)
            yield self
        finally:
            self._relaunch(*training)

    def _relaunch(self, context_length: int | None, rope_scaling: dict | None) -> None:
        self.fleet.relaunch(context_length, rope_scaling, self.seed)
        self.context_length, self.rope_scaling = context_length, rope_scaling

    def evaluation_seed(self, seed: int):
        """The servers' sampling state is theirs and per request: nothing to save or restore."""
        return contextlib.nullcontext()

    def rng_state(self) -> None:
        """None: the sampling state is the servers' (a checkpoint saves none)."""
        return None

    def load_rng_state(self, state) -> None:
        """Nothing to resume: the sampling state is the servers'."""

    def close(self) -> None:
        """Stop the servers this engine launched (their whole process groups)."""
        self.router.close()
        self.fleet.stop()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- generation ----------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        sampling: SamplingParams,
        keys: list[str | None] | None = None,
    ) -> list[Generation | EngineFault]:
        """One concurrent request per prompt; `keys` (one per prompt: its episode) make routing sticky. A request that
        fails on every try comes back as an `EngineFault` in its slot; one that gets a stale sample on every try (no
        server holds the engine's weights) or that a server rejects as invalid raises."""
        keys = keys or [None] * len(prompts)
        futures = [
            self.pool.submit(self._generate_one, p, n, sampling, key)
            for p, n, key in zip(prompts, max_new_tokens, keys)
        ]
        return [future.result() for future in futures]

    def release(self, keys: Iterable[str]) -> None:
        """These episodes ended: forget their routes."""
        self.router.forget(keys)

    def _generate_one(
        self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, key: str | None = None
    ) -> Generation | EngineFault:
        if max_new_tokens <= 0:
            return Generation([], [], "length", self.weight_version)
        body = self.backend.request_body(prompt, max_new_tokens, sampling)
        return self.router.generate(body, key, lambda reply: self.backend.parse(reply, self.weight_version))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push the trainer's (HF name, tensor) stream to every server; later samples must carry `version`.
        Every weight of the base checkpoint must come, and nothing else: a partial update would mix two policies."""
        with self.sync_lock:
            self.weight_sync.update(named_tensors, version)

    def resync(self, server: Server) -> None:
        """Bring one recovered server to the fleet's weights (the backend's weight sync must offer `resync`)."""
        with self.sync_lock:
            self.weight_sync.resync(server, self.fleet.weight_version)
