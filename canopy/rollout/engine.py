"""Inference engines. `Engine` is the contract a run relies on; `LocalEngine` generates in-process (CPU, the
embedded default) with the same contract as the SGLang servers (`canopy.rollout.sglang_engine`): token ids in,
token ids + logprobs out, each sample stamped with the weight version, weights pushed as an HF-format state
dict after every optimizer step. A run builds its engine once and lends it out: to the data module for
rollouts, and to evaluators, which ask it for the budget they evaluate at (`at_budget`) instead of building
engines of their own.
"""

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Protocol

import torch
from transformers import AutoConfig, AutoModelForCausalLM


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter


class EngineFault(RuntimeError):
    """A generation request the serving layer failed (server dead, request aborted or timed out) on every try.
    Not the agent's doing: its episode is quarantined (Appendix G)."""

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


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus (top-p) filtering of temperature-scaled logits [B, V]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token crossing top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Engine(Protocol):
    """What a run needs from its one inference engine."""

    weight_version: int  # the version of the weights it samples from; every sample carries it
    dtype: str  # the dtype it computes in ("float32", "bfloat16", ...): the audit's gap bounds depend on it
    # optional `concurrent = True`: it serves requests as they come (SGLang); the agent loop then sends each
    # episode's requests one by one, from the episode's thread, with `keys=[episode key]` for sticky routing.
    # Without it the engine generates a batch at a time and the loop gathers the requests (`run_episodes`).

    def generate(
        self, prompts: list[list[int]], max_new_tokens: list[int], sampling: SamplingParams
    ) -> list[Generation | EngineFault]:
        """One completion per prompt; a request the serving layer failed comes back as an `EngineFault`."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Take the trainer's weights (HF names, streamed) as `version`; all of them, or none."""

    def at_budget(self, context_length: int, rope_scaling: dict | None) -> "Engine | None":
        """An engine serving the current weights at this context length and RoPE scaling (Appendix I's enlarged
        budget): itself when its own settings serve it, None when that takes relaunched servers."""

    def evaluation_seed(self, seed: int) -> ContextManager:
        """Sample with `seed` inside the block and leave the training sampler where it was."""

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
        self.dtype = dtype if dtype is not None or callable(engine) else getattr(engine, "dtype", None)

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


class LocalEngine:
    """Batched sampling with a KV cache (and Qwen3.5's recurrent state) from the HF causal LM of the checkpoint
    (Qwen3, Qwen3.5), in-process: float32 on the CPU by default, or `dtype` on `device` (a GPU's bf16 engine, whose
    gap to the trainer the device check measures). Tokens are drawn on the CPU from the seeded generator."""

    def __init__(
        self,
        model_path: str | Path,
        stop_token_ids: list[int],
        pad_token_id: int,
        seed: int = 0,
        rope_scaling: dict | None = None,
        dtype: str = "float32",
        device: str = "cpu",
    ):
        """`rope_scaling` (e.g. YaRN for the enlarged budget, Appendix I) overrides the HF config's RoPE on load."""
        self.model_path, self.rope_scaling, self.seed = model_path, rope_scaling, seed
        self.dtype, self.device = dtype, torch.device(device)
        self.siblings: dict[str, LocalEngine] = {}  # the same weights at other RoPE scalings, by `at_budget`
        config = AutoConfig.from_pretrained(model_path)
        if rope_scaling:
            config.rope_parameters = {**config.rope_parameters, **rope_scaling}
        if config.model_type.startswith("qwen3_5") and self.device.type == "cpu":
            from canopy.modules.gated_delta import transformers_on_torch_kernels

            transformers_on_torch_kernels()  # fla's Triton kernels cannot run on the CPU
        model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=getattr(torch, dtype))
        self.model = model.to(self.device).eval()
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)))
        self.pad_token_id = pad_token_id
        self.weight_version = 0
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the trainer's weights one (HF name, tensor) pair at a time, then adopt its version.
        Every parameter must be updated: a partial update would mix two policies."""
        params = dict(self.model.named_parameters())
        missing = set(params)
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight update names {name!r}, which the engine's model does not have")
            params[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise RuntimeError(
                f"weight update to version {version} missed {sorted(missing)[:3]}: engine weights are mixed"
            )
        self.weight_version = version

    def at_budget(self, context_length: int, rope_scaling: dict | None) -> "LocalEngine":
        """Itself, or for another RoPE scaling an in-process sibling holding a copy of the current weights."""
        if (rope_scaling or None) == (self.rope_scaling or None):
            return self
        key = repr(sorted(rope_scaling.items())) if rope_scaling else "none"
        if key not in self.siblings:
            stops = self.stop_token_ids.tolist()
            self.siblings[key] = LocalEngine(
                self.model_path, stops, self.pad_token_id, self.seed, rope_scaling, self.dtype, str(self.device)
            )
        sibling = self.siblings[key]
        if sibling.weight_version != self.weight_version:
            sibling.update_weights(self.model.named_parameters(), self.weight_version)
        return sibling

    @contextlib.contextmanager
    def evaluation_seed(self, seed: int):
        state = self.generator.get_state()
        self.generator.manual_seed(seed)
        try:
            yield
        finally:
            self.generator.set_state(state)

    def close(self) -> None:
        self.siblings.clear()

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: list[int], sampling: SamplingParams
    ) -> list[Generation]:
        if not prompts:
            return []
        batch = len(prompts)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[i, width - len(prompt) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        limits = torch.tensor(max_new_tokens)
        outputs = [[] for _ in range(batch)]
        logprobs = [[] for _ in range(batch)]
        finished = limits <= 0
        reasons = ["length"] * batch
        cache = None
        step_ids, step_positions = input_ids, position_ids
        for step in range(int(limits.max().clamp_min(0))):
            out = self.model(
                input_ids=step_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                position_ids=step_positions.to(self.device),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.cache
            scaled = out.logits[:, -1, :].float().cpu() / sampling.temperature
            token_logprobs = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
            for i in torch.nonzero(~finished).flatten().tolist():
                token = int(tokens[i])
                outputs[i].append(token)
                logprobs[i].append(float(token_logprobs[i, token]))
                if token in self.stop_token_ids:
                    finished[i], reasons[i] = True, "stop"
                elif len(outputs[i]) >= limits[i]:
                    finished[i] = True
            if bool(finished.all()):
                break
            tokens = torch.where(finished, torch.tensor(self.pad_token_id), tokens)
            step_ids = tokens.unsqueeze(-1)
            step_positions = step_positions[:, -1:] + 1
            attention_mask = torch.cat([attention_mask, (~finished).long().unsqueeze(-1)], dim=-1)
        return [Generation(outputs[i], logprobs[i], reasons[i], self.weight_version) for i in range(batch)]
