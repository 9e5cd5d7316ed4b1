"""Inference engines. `LocalEngine` generates in-process (CPU, the embedded default) with the same contract
as the SGLang server: token ids in, token ids + logprobs out, each sample stamped with the weight version,
weights pushed as an HF-format state dict after every optimizer step.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, Qwen3ForCausalLM


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


class LocalEngine:
    """Batched sampling with a KV cache from an HF `Qwen3ForCausalLM`, in-process."""

    def __init__(
        self,
        model_path: str | Path,
        stop_token_ids: list[int],
        pad_token_id: int,
        seed: int = 0,
        rope_scaling: dict | None = None,
    ):
        """`rope_scaling` (e.g. YaRN for the enlarged budget, Appendix I) overrides the HF config's RoPE on load."""
        config = AutoConfig.from_pretrained(model_path)
        if rope_scaling:
            config.rope_parameters = {**config.rope_parameters, **rope_scaling}
        self.model = Qwen3ForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32).eval()
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
                input_ids=step_ids,
                attention_mask=attention_mask,
                position_ids=step_positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.cache
            scaled = out.logits[:, -1, :].float() / sampling.temperature
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
