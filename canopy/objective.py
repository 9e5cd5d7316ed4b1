"""CANOPY objective: group-standardized advantages (Eq. 3) and the KL-anchored token-mean loss (Eqs. 6-8)."""

import torch


def step_advantages(
    rewards: torch.Tensor,
    quarantined: torch.Tensor,
    quarantine_as_failure: bool = False,
    present: torch.Tensor | None = None,
    divide_by_std: bool = True,
) -> torch.Tensor:
    """Quarantine, then Eq. 3, for all of a step's groups at once: [G, n] rewards and quarantine flags -> [G, n].

    Quarantine precedes scoring (Appendix G): a quarantined episode leaves its group before the group's mean and
    POPULATION std (divide by n) are taken, and gets advantage 0; with `quarantine_as_failure` (the sensitivity
    ablation) it stays in the group with reward 0 instead. A degenerate group (all rewards equal, or fewer than
    two left) gives all zeros, never NaN. A lone success among n gets exactly sqrt(n-1) (Appendix B). Groups of
    different sizes are padded to n; `present` marks their real entries (the padding takes no part, and gets 0).
    Without `divide_by_std` (the no_std ablation, as Dr. GRPO; LOOP's leave-one-out baseline is this times
    n/(n-1)) an advantage is its reward minus the group's mean, all else alike: a lone success among n gets 1 - 1/n.
    """
    quarantined = quarantined.to(torch.bool)
    present = torch.ones_like(quarantined) if present is None else present.to(torch.bool)
    valid = present & (torch.ones_like(quarantined) if quarantine_as_failure else ~quarantined)
    rewards = torch.where(quarantined, 0.0, rewards.to(torch.float64))
    count = valid.sum(-1, keepdim=True).clamp_min(1)
    mean = torch.where(valid, rewards, 0.0).sum(-1, keepdim=True) / count
    centered = torch.where(valid, rewards - mean, 0.0)
    std = (centered.pow(2).sum(-1, keepdim=True) / count).sqrt()
    scale = torch.where(valid, rewards.abs(), 0.0).amax(-1, keepdim=True).clamp_min(1.0)
    informative = (valid.sum(-1, keepdim=True) >= 2) & (std > 1e-12 * scale)
    scaled = centered / torch.where(informative, std, 1.0) if divide_by_std else centered
    advantages = torch.where(informative & valid, scaled, 0.0)
    return advantages.to(torch.float32)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: exp(ref-lp) - (ref-lp) - 1 >= 0."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def token_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    pg_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The per-token objective, [B, T] (advantages [B]): the ratio of Eq. 6, the clipped surrogate S of Eq. 7
    and the k3 KL anchor; `term` = -w * S + beta * k3 is what Eq. 8 aggregates, w = 1 in the recipe (else the
    opt-in rollout correction's detached weights, `canopy.mismatch`)."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    if pg_weights is not None:
        surrogate = pg_weights.detach() * surrogate
    kl = k3_kl(logprobs, ref_logprobs)
    return {
        "term": -surrogate + kl_coef * kl,
        "surrogate": surrogate,
        "kl": kl,
        "log_ratio": log_ratio,
        "clip_binds": unclipped > clipped,  # the min picks the clipped branch, either side
    }


def aggregation_weights(
    action_mask: torch.Tensor,
    aggregation: str = "token-mean",
    num_action_tokens: float | None = None,
    num_sequences: float | None = None,
) -> torch.Tensor:
    """Eq. 8's weight of each token's term, [B, T]. "token-mean": M_it / N, N the action tokens of the whole batch
    (pass the batch-wide count when micro-batching, so that accumulated gradients equal the full-batch one);
    "seq-mean" (ablation): M_it / |o_i| / the number of sequences (`num_sequences` plays the same role)."""
    mask = action_mask if action_mask.is_floating_point() else action_mask.float()
    if aggregation == "token-mean":
        denom = mask.sum() if num_action_tokens is None else torch.as_tensor(num_action_tokens, dtype=mask.dtype)
        return mask / denom.clamp_min(1.0)
    if aggregation == "seq-mean":
        per_seq_len = mask.sum(-1, keepdim=True).clamp_min(1.0)
        has_actions = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
        n_seq = has_actions.sum() if num_sequences is None else torch.as_tensor(num_sequences, dtype=mask.dtype)
        return mask / per_seq_len / n_seq.clamp_min(1.0)
    raise ValueError(f"unknown loss aggregation {aggregation!r}: use 'token-mean' or 'seq-mean'")


def canopy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    aggregation: str,
    num_action_tokens: float | None = None,
    num_sequences: float | None = None,
    pg_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CANOPY loss, Eq. 8: (1/N) sum_i sum_t M_it [ -S_it + beta * k3_it ] (`token_objective` weighted by
    `aggregation_weights`). Metrics are token-level diagnostics pooled over action tokens (Appendix C) and
    normalized the same way, so they also accumulate exactly over micro-batches. `pg_clipfrac` and `ppo_kl` are
    the trainer's own ratio pi_theta / pi_old: identically 0 with one update per batch (old = current), they
    only move in the half_minibatch ablation; the engine-trainer gap is `canopy.mismatch`'s."""
    mask = action_mask.to(logprobs.dtype)
    terms = token_objective(
        logprobs,
        old_logprobs,
        ref_logprobs,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        kl_coef=kl_coef,
        pg_weights=pg_weights,
    )
    weights = aggregation_weights(mask, aggregation, num_action_tokens, num_sequences)
    loss = (terms["term"] * weights).sum()
    with torch.no_grad():
        token_weights = aggregation_weights(mask, "token-mean", num_action_tokens)
        metrics = {
            "pg_clipfrac": (terms["clip_binds"].to(mask.dtype) * token_weights).sum(),
            "ppo_kl": (-terms["log_ratio"] * token_weights).sum(),
            "kl": (terms["kl"] * token_weights).sum(),
            "pg_loss": (-terms["surrogate"] * weights).sum(),
        }
    return loss, metrics
