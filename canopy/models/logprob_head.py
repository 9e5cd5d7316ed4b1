"""The output projection of the trainer's models as a log-probability head (pi_theta / pi_ref of Eqs. 6-8): each
position's target log-probability and entropy at the sampling temperature, computed chunk by chunk over tokens so
that the [tokens, vocab] logits never exist (at Table A1's sizes one float32 copy of them is 100 GB), for whole and
for vocabulary-sharded (TP) weights."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard
from torchtitan.models.common import Linear


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each position's target and the entropy of its distribution, at the sampling temperature,
    from whole logits [..., V] (outputs [...]). The unchunked form: what `LogprobHead` is tested and benchmarked
    against (`bench/logprob_head.py`), for logits that exist anyway."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


class LogprobHead(Linear):
    """The trainer's output projection (lm_head). Called with `targets`, it returns each position's target
    log-probability and entropy at the sampling temperature (pi_theta / pi_ref of Eqs. 6-8) chunk by chunk over
    tokens, never holding the [tokens, vocab] logits (`ChunkedLogprobs`); without, the logits, as a plain Linear.

    Being the lm_head module itself, it runs inside FSDP's hooks for its parameters (unsharded in forward,
    gradients reduce-scattered in backward, as for a plain Linear) and TorchTitan's TP input redistribution
    (hidden states replicated over TP, the weight sharded over the vocabulary)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        pass

    def forward(
        self,
        input: torch.Tensor,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        chunk_tokens: int = 2048,
    ):
        if targets is None:
            return super().forward(input)
        return chunked_token_logprobs(input, self.weight, targets, temperature, chunk_tokens)


def chunked_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs(hidden @ weight.T, targets, temperature)` without the logits: [..., D] hidden states and
    [V, D] weight in, [...] log-probabilities and entropies out, `chunk_tokens` tokens at a time.

    Under TP the weight is sharded over the vocabulary (`Shard(0)`) and the hidden states replicated: each rank
    projects onto its own V/tp rows, and the log-softmax's max and sum of exponentials, the target's
    log-probability and the entropy are all-reduced over the TP group. The hidden states' gradient is then a
    partial sum per rank, which DTensor reduces on the way back (as for TP's plain output projection)."""
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        if weight.placements != (Shard(0),):
            raise ValueError(f"expected the output projection sharded over the vocabulary, got {weight.placements}")
        group = weight.device_mesh.get_group()
        vocab_start = dist.get_rank(group) * -(-weight.shape[0] // dist.get_world_size(group))  # torch.chunk's
        weight = weight.to_local()
    if isinstance(hidden, DTensor):
        if not all(p.is_replicate() for p in hidden.placements):
            raise ValueError(f"expected hidden states replicated over TP, got {hidden.placements}")
        hidden = hidden.to_local(grad_placements=[Partial()] * len(hidden.placements))
    shape = targets.shape
    chosen, entropy = ChunkedLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), temperature, chunk_tokens, group, vocab_start
    )
    return chosen.view(shape), entropy.view(shape)


class ChunkedLogprobs(torch.autograd.Function):
    """Target log-probability and entropy of softmax(h W^T / T) per token, `chunk` tokens at a time; backward
    recomputes each chunk's logits. At most one chunk's [chunk, V] logits (and two float32 working copies) exist
    at any time; saved for backward are only h, W and per-token statistics.

    With z = h W^T / T, log p = z - max - log sum exp(z - max), H = -sum p log p:
        d log p_y / dz = onehot(y) - p,    dH / dz = -p (log p + H),
    so for upstream gradients g_y, g_H:  dL/dz = g_y onehot(y) - p (g_y + g_H (log p + H)),  dL/dh = dL/dz W / T,
    dL/dW = (dL/dz)^T h / T, accumulated over chunks in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, group, vocab_start):
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        stats = hidden.new_empty(4, n, dtype=dtype)  # target log p, entropy, shift, log sum exp
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            log_p, shift, log_sum = _log_softmax_chunk(hidden[start:end], weight, temperature, group)
            picked, owned = _pick_targets(log_p, targets[start:end] - vocab_start)
            partial = torch.stack([torch.where(owned, picked, 0.0), log_p.exp().mul_(log_p).sum(-1)])
            if group is not None:
                dist.all_reduce(partial, group=group)
            stats[0, start:end], stats[1, start:end] = partial[0], -partial[1]
            stats[2, start:end], stats[3, start:end] = shift, log_sum
            del log_p  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, targets, stats)
        ctx.temperature, ctx.chunk, ctx.group, ctx.vocab_start = temperature, chunk, group, vocab_start
        return stats[0].clone(), stats[1].clone()

    @staticmethod
    def backward(ctx, grad_chosen, grad_entropy):
        hidden, weight, targets, stats = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = weight.new_zeros(weight.shape, dtype=stats.dtype) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h, g_y, g_h = hidden[start:end], grad_chosen[start:end, None], grad_entropy[start:end, None]
            log_p = _scaled_logits(h, weight, ctx.temperature).sub_(stats[2, start:end, None])
            log_p.sub_(stats[3, start:end, None])
            grad_z = log_p.exp()  # p, then -p (g_y + g_H (log p + H)) in place
            grad_z.mul_(log_p.add_(stats[1, start:end, None]).mul_(g_h).add_(g_y)).neg_()
            del log_p
            local = targets[start:end] - ctx.vocab_start
            rows = _owned(local, weight.shape[0]).nonzero().squeeze(-1)
            grad_z[rows, local[rows]] += g_y[rows, 0]
            grad_z = grad_z.div_(ctx.temperature).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_z @ weight
            if grad_weight is not None:
                _accumulate_weight_grad(grad_weight, grad_z, h)
            del grad_z  # before the next chunk's logits exist
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


VOCAB_BLOCK = 16384  # rows of the head's weight gradient formed at a time in a lower precision than float32


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_z: torch.Tensor, hidden: torch.Tensor) -> None:
    """grad_weight (float32) += grad_z^T hidden. In float32 in place; in bf16 one vocabulary block at a time, so
    that no weight-sized temporary exists besides the float32 accumulator."""
    if grad_z.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_z.T, hidden)
        return
    for start in range(0, grad_weight.shape[0], VOCAB_BLOCK):
        grad_weight[start : start + VOCAB_BLOCK] += (grad_z[:, start : start + VOCAB_BLOCK].T @ hidden).float()


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = h W^T / T in float32 (float64 stays), as `token_logprobs` computes it from the projection's output."""
    logits = hidden @ weight.T
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).div_(temperature)


def _log_softmax_chunk(hidden, weight, temperature, group):
    """log p = z - max - log sum exp(z - max) of one chunk, over the whole vocabulary (all-reduced over the TP
    group), computed in place in the chunk's one float32 buffer; also the max and the log sum exp per token."""
    z = _scaled_logits(hidden, weight, temperature)
    shift = z.amax(-1)
    if group is not None:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    z.sub_(shift[:, None])
    sum_exp = z.exp().sum(-1)
    if group is not None:
        dist.all_reduce(sum_exp, group=group)
    log_sum = sum_exp.log()
    return z.sub_(log_sum[:, None]), shift, log_sum


def _pick_targets(log_p: torch.Tensor, local_targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p of each token's target where this rank's vocabulary slice holds it (`owned`)."""
    picked = log_p.gather(-1, local_targets.clamp(0, log_p.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return picked, _owned(local_targets, log_p.shape[-1])


def _owned(local_targets: torch.Tensor, width: int) -> torch.Tensor:
    """Which targets (as offsets into this rank's vocabulary slice of `width` rows) the slice holds."""
    return (local_targets >= 0) & (local_targets < width)
