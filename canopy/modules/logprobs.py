"""The trainer's log-probabilities of the sampled tokens (pi_theta and pi_ref of Eqs. 6-8), kept apart from the
step that uses them: per-position alignment of a rollout batch (with the context-parallel split), and the
target log-probability and entropy at the sampling temperature, whole or from vocabulary-sharded (TP) logits."""

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import DTensor, Shard
from torchtitan.distributed.context_parallel import cp_shard

from canopy.datamodules.rollout import RolloutBatch


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


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each position's target and the entropy of its distribution, at the sampling temperature.

    `logits` [B, T, V] and `targets` [B, T] are aligned (see `sequence_inputs`); outputs are [B, T]. Scoring at
    the engine's temperature makes the trainer's pi_theta the distribution the rollouts were actually drawn from.
    Logits that tensor parallelism leaves sharded over the vocabulary go to `vocab_parallel_token_logprobs`.
    """
    if isinstance(logits, DTensor):
        return vocab_parallel_token_logprobs(logits, targets, temperature)
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


def vocab_parallel_token_logprobs(
    logits: DTensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` for logits column-sharded over the vocabulary (TP's output projection, `Shard(-1)`).

    Each rank keeps its [B, T, V/tp] slice: log-softmax = logit - max - log sum exp, with the max and the sum of
    exponentials all-reduced over the TP group, and the target's log-probability (pi_theta of Eq. 6-8) and the
    entropy summed from the shards. Exact and differentiable, without building the full [B, T, V] logits.
    Gradients: every shard uses the sum of exponentials, so its backward sums over the group too; the outputs
    feed the same loss on every TP rank, so theirs is the identity.
    """
    if logits.placements != (Shard(logits.ndim - 1),):
        raise ValueError(f"expected logits sharded over the vocabulary by TP, got placements {logits.placements}")
    group = logits.device_mesh.get_group()
    local = logits.to_local().float() / temperature
    width = -(-logits.shape[-1] // dist.get_world_size(group))  # DTensor shards like torch.chunk
    shift = local.detach().amax(-1, keepdim=True)  # any shift gives the same log-softmax and gradient
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    shifted = local - shift
    log_probs = shifted - all_reduce(shifted.exp().sum(-1, keepdim=True), group=group).log()
    targets = targets - dist.get_rank(group) * width
    owned = (targets >= 0) & (targets < local.shape[-1])
    picked = log_probs.gather(-1, targets.clamp(0, local.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    partials = torch.stack([torch.where(owned, picked, 0.0), (log_probs.exp() * log_probs).sum(-1)])
    chosen, neg_entropy = _SumOverGroup.apply(partials, group)
    return chosen, -neg_entropy


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum over the TP group whose backward is the identity: for results every rank uses alike."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
