"""The trainer's log-probabilities of the sampled tokens (pi_theta and pi_ref of Eqs. 6-8), kept apart from the
step that uses them: per-position alignment of a rollout batch (with the context-parallel split), and each
position's target log-probability and entropy at the sampling temperature from a model whose head is a
`LogprobHead` (`canopy.models.logprob_head`: chunked over tokens, vocabulary-sharded under TP)."""

import torch
from torchtitan.distributed.context_parallel import cp_shard

from canopy.step import RolloutBatch


def sequence_inputs(batch: RolloutBatch, cp_mesh=None, **per_token: torch.Tensor) -> dict[str, torch.Tensor]:
    """A micro-batch as [B, T] tensors aligned per position t: the token there, the target it predicts
    (`input_ids[t+1]`), that target's action mask and engine logprob, the position, and `per_token` extras that
    are already aligned (reference / old logprobs). The last position predicts nothing and is masked out.

    Aligned before any sharding, each position carries everything its loss term needs. With context parallelism
    (`cp_mesh`), T is padded to a multiple of 2 x cp and every tensor is split along the sequence by TorchTitan's
    head-tail balanced `cp_shard`, as its trainer splits inputs, labels and positions.
    """
    ids = batch.input_ids
    width = padded_width(ids.shape[1], cp_mesh)

    def aligned(x: torch.Tensor, shift: int) -> torch.Tensor:  # x[:, t + shift] at position t, zeros past the end
        x = x[:, shift:]
        return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1])], dim=1)

    inputs = {
        "tokens": aligned(ids, 0),
        "targets": aligned(ids, 1),
        "action_mask": aligned(batch.action_mask, 1),
        "engine_logprobs": aligned(batch.engine_logprobs, 1),
        "positions": torch.arange(width, device=ids.device).expand(ids.shape[0], -1),
        **{name: aligned(value, 0) for name, value in per_token.items()},
    }
    if cp_mesh is None:
        return inputs
    sharded, _ = cp_shard(cp_mesh, tuple(inputs.values()), None, "headtail")
    return dict(zip(inputs, sharded))


def padded_width(width: int, cp_mesh) -> int:
    """`width` rounded up to a multiple of 2 x cp: head-tail balancing gives each CP rank two equal chunks."""
    multiple = 1 if cp_mesh is None else 2 * cp_mesh.size()
    return -(-width // multiple) * multiple


def model_token_logprobs(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], temperature: float, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`model`'s target log-probabilities and entropies [B, T] for aligned `inputs` (`sequence_inputs`): the
    decoder's final hidden states (TorchTitan's `_skip_lm_head`, as its chunked loss runs it), then the model's
    `LogprobHead`, `chunk_tokens` tokens at a time. Under CP each rank scores its own positions."""
    model._skip_lm_head = True
    try:
        hidden = model(inputs["tokens"], inputs["positions"])
    finally:
        model._skip_lm_head = False
    return model.lm_head(hidden, inputs["targets"], temperature, chunk_tokens)
