"""CANOPY objective: group-standardized advantages (Eq. 3) and the KL-anchored token-mean loss (Eqs. 6-8)."""

import torch


def group_advantages(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Standardized within-group advantages for one group (Eq. 3, Appendix G ordering).

    Mean and POPULATION std (divide by n) are taken over the valid (non-quarantined) entries only;
    quarantined entries get 0. A degenerate group (all valid rewards equal, or fewer than two valid)
    gives all zeros. A lone success among n valid gets exactly sqrt(n-1) (Appendix B).
    """
    rewards = rewards.to(torch.float64)
    valid = valid.to(torch.bool)
    advantages = torch.zeros_like(rewards)
    kept = rewards[valid]
    if kept.numel() < 2:
        return advantages.to(torch.float32)
    centered = kept - kept.mean()
    std = centered.pow(2).mean().sqrt()
    if std <= 1e-12 * max(1.0, kept.abs().max().item()):
        return advantages.to(torch.float32)
    advantages[valid] = centered / std
    return advantages.to(torch.float32)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: exp(ref-lp) - (ref-lp) - 1 >= 0."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def canopy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 1e-4,
    aggregation: str = "token-mean",
    num_action_tokens: float | None = None,
    num_sequences: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CANOPY loss, Eq. 8: (1/N) sum_i sum_t M_it [ -S_it + beta * k3_it ].

    Tensors are [B, T]; advantages are [B]. S_it is the clipped surrogate of Eq. 7 with the ratio of Eq. 6.
    "token-mean" divides by N, the number of action tokens; pass the batch-wide count as
    `num_action_tokens` when micro-batching so that accumulated gradients equal the full-batch gradient.
    "seq-mean" (ablation) averages per sequence, then over sequences (`num_sequences` plays the same role).
    Metrics are sums-normalized the same way, so they also accumulate exactly over micro-batches.
    """
    mask = action_mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    kl = k3_kl(logprobs, ref_logprobs)
    per_token = -surrogate + kl_coef * kl

    if aggregation == "token-mean":
        denom = mask.sum() if num_action_tokens is None else torch.as_tensor(num_action_tokens, dtype=mask.dtype)
        weights = mask / denom.clamp_min(1.0)
    elif aggregation == "seq-mean":
        per_seq_len = mask.sum(-1, keepdim=True).clamp_min(1.0)
        has_actions = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
        n_seq = has_actions.sum() if num_sequences is None else torch.as_tensor(num_sequences, dtype=mask.dtype)
        weights = mask / per_seq_len / n_seq.clamp_min(1.0)
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}: use 'token-mean' or 'seq-mean'")
    loss = (per_token * weights).sum()

    with torch.no_grad():
        # token-level diagnostics, always pooled over action tokens (Appendix C)
        token_weights = mask / (
            mask.sum() if num_action_tokens is None else torch.as_tensor(num_action_tokens, dtype=mask.dtype)
        ).clamp_min(1.0)
        clip_binds = (unclipped > clipped).to(mask.dtype)  # the min picks the clipped branch, either side
        metrics = {
            "pg_clipfrac": (clip_binds * token_weights).sum(),
            "ppo_kl": (-log_ratio * token_weights).sum(),
            "kl": (kl * token_weights).sum(),
            "pg_loss": (-surrogate * weights).sum(),
        }
    return loss, metrics
