"""The engine contract (Sec. 3.1: token ids in, token ids + logprobs out, each sample stamped with the weight
version; weights pushed as an HF-format state dict after every optimizer step): `SamplingParams`, `Generation`,
`EngineFault` (Appendix G), the `Engine` protocol, and `EngineHandle`, through which a run builds its one engine once
and lends it out: to the data module for rollouts, and to evaluators, which ask it for the budget they evaluate at
(`at_budget`, Appendix I). Implementations: `canopy.rollout.local.LocalEngine` (in-process, the embedded default) and
the HTTP server engines (`canopy.rollout.sglang`, `.vllm`).
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ContextManager, Protocol, runtime_checkable

import torch

from canopy.errors import require


@dataclass
class SamplingParams:
    """`sampling.*` (and a budget group's `eval.enlarged.sampling`): the schema; each budget group, conf/budget/*.yaml,
    writes its values."""

    temperature: float
    top_p: float  # 1.0: no nucleus filter
    top_k: int  # -1: no top-k filter

    @classmethod
    def of(cls, sampling) -> "SamplingParams":
        """From the `sampling` config group."""
        return cls(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)

    def validate(self, key: str = "sampling") -> None:
        """`sampling.*` (a budget group's, whose schema this is): one line naming the fix on the first bad value."""
        require(self.temperature > 0, f"{key}.temperature={self.temperature} must be > 0")
        require(0 < self.top_p <= 1, f"{key}.top_p={self.top_p} must lie in (0, 1]")
        require(self.top_k == -1 or self.top_k >= 1, f"{key}.top_k={self.top_k}: use -1 (off) or >= 1")


class EngineFault(RuntimeError):
    """A generation request the serving layer failed (server dead, request aborted or timed out) on every try.
    Not the agent's doing: its episode is quarantined (Appendix G)."""

    worker = None  # no environment worker served it (an `EnvironmentFault` names the pool slot it happened on)

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail

    def __reduce__(self):
        return type(self), (self.reason, self.detail)


@dataclass
class Generation:
    """One completion: generated ids (the stop token included), their logprobs at the sampling temperature,
    why it stopped ("stop" or "length") and the weight version that produced it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


@runtime_checkable
class Engine(Protocol):
    """What a run needs from its one inference engine: every member below, on every engine (no probing)."""

    weight_version: int  # the version of the weights it samples from; every sample carries it
    dtype: str  # the dtype it computes in ("float32", "bfloat16", ...): the audit's gap bounds depend on it
    concurrent: bool  # True: it serves requests as they come (the HTTP engines), and the agent loop sends each
    # episode's requests one by one, from the episode's thread; False: it generates a batch at a time (the local
    # engine), and the loop gathers the requests (`run_episodes`)
    counters: Mapping[str, int]  # running counts of what it computed (the local engine's prefill / decode tokens and
    # session hits), logged per step as `engine/<name>`; empty for server engines
    can_relaunch: bool  # whether `relaunched` may be used: the engine launched servers it can relaunch at a budget

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        sampling: SamplingParams,
        keys: list[str | None] | None = None,
    ) -> list[Generation | EngineFault]:
        """One completion per prompt; a request the serving layer failed comes back as an `EngineFault`. `keys` name
        each prompt's episode: its turns go to one server (SGLang), its cache is kept between them (local)."""

    def release(self, keys: Iterable[str]) -> None:
        """These episodes ended: drop what the engine keeps of them (sessions, routes). Safe from any thread."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Take the trainer's weights (HF names, streamed) as `version`; all of them, or none."""

    def at_budget(self, context_length: int, rope_scaling: dict | None) -> "Engine | None":
        """An engine serving the current weights at this context length and RoPE scaling (Appendix I's enlarged
        budget): itself when its own settings serve it, None when that takes relaunched servers."""

    def relaunched(self, context_length: int, rope_scaling: dict | None) -> ContextManager["Engine"]:
        """A block inside which the engine's servers run relaunched at this context length and RoPE scaling, from
        the base weights (push the policy's next), relaunched with the training settings afterwards (Appendix I's
        end-of-training evaluation). Only where `can_relaunch`; elsewhere it raises."""

    def evaluation_seed(self, seed: int) -> ContextManager:
        """Sample with `seed` inside the block and leave the training sampler where it was."""

    def rng_state(self) -> Any | None:
        """The state of the sampler it draws tokens from in this process (saved with a checkpoint, for an exact
        resume); None where the sampling state is the servers' (nothing to save)."""

    def load_rng_state(self, state: Any) -> None:
        """Resume the sampler from a `rng_state()`; nothing to do where the sampling state is the servers'."""

    def close(self) -> None:
        """Release what the engine started."""


class EngineHandle:
    """The run's one engine, owned once and lent out: built on first use, and only by the process that generates
    (global rank 0; the other ranks of a sharded run never build one). The data module generates through it,
    evaluators borrow it, and the module pushes its weights into it after every optimizer step with `sync`:
    the one path from trainer to engine. `version` is the weight version the engine was last synced to; `dtype`
    the engine's, known to every process (give it with a builder; the on-policy audit needs it)."""

    def __init__(self, engine: "Engine | Callable[[], Engine]", dtype: str | None = None):
        self._engine, self.version = engine, 0
        self.dtype = dtype if dtype is not None or callable(engine) else engine.dtype

    @property
    def engine(self) -> Engine:
        if callable(self._engine):  # a builder (an engine object is not callable)
            self._engine = self._engine()
        return self._engine

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, generating: bool) -> None:
        """Stream the trainer's weights (HF names) into the engine as `version`. Every process walks the stream
        (gathering a sharded tensor is a collective); only the generating one builds the engine and keeps them."""
        if generating:
            self.engine.update_weights(named_tensors, version)
        else:
            for _ in named_tensors:
                pass
        self.version = version

    def close(self) -> None:
        """Release the engine (servers, siblings), if this process built one."""
        if not callable(self._engine):
            self._engine.close()
