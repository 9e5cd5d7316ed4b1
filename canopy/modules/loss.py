"""Eq. 8 as trained: one micro-batch's loss, read top to bottom next to the paper (Sec. 3.3, Eqs. 6-8, App. C).

    L = (1/N) sum_i sum_t M_it [ -w_it S_it + beta k3(pi_theta, pi_ref)_it ]  -  c_H H

S is the clipped surrogate of Eq. 7 on the ratio pi_theta / pi_old of Eq. 6, k3 the KL anchor to the frozen base,
N the action tokens of the whole (mini)batch, pooled over every micro-batch and data-parallel shard (token-mean;
seq-mean is the ablation), w = 1 in the recipe (else the opt-in rollout correction's detached weights) and c_H = 0
in the recipe (the entropy bonus is an option).
"""

from dataclasses import dataclass

import torch

from canopy.mismatch import correction_metrics, mismatch_metrics, sequence_log_ratio
from canopy.modules.parallel import sum_over_context
from canopy.objective import canopy_loss


@dataclass(frozen=True)
class Pooled:
    """What Eq. 8 divides by, counted over the whole (mini)batch on every shard: N (`tokens`), the sequences with an
    action token (`sequences`, seq-mean's), and each sequence metric's share (`sequence_share`: every CP rank holds
    each of its shard's rows, so each adds 1/cp of a sequence)."""

    tokens: float
    sequences: float
    sequence_share: float


def trained_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    algorithm,
    pooled: Pooled,
    cp_mesh=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's part of Eq. 8 for one micro-batch, and its metric partials (`actor/`, `mismatch/`, `correction/`).

    `logprobs` / `entropy` [B, T] are the policy's at its positions (`inputs`, aligned by `sequence_inputs`, CP split
    when `cp_mesh` is given), `inputs` also carries the action mask M, the engine's logprobs mu, the reference's and,
    past the first update of a split batch only, pi_old's. `algorithm` is the run's `AlgorithmSettings` (its
    `rollout_correction` gives w)."""
    a, mask, correction = algorithm, inputs["action_mask"], algorithm.rollout_correction
    # pi_old: the policy itself, detached, when strictly on-policy (one update per batch: the ratio is 1)
    old = logprobs.detach() if "old_logprobs" not in inputs else inputs["old_logprobs"]
    # the engine-trainer mismatch r = log pi_old - log mu, per action token and per sequence (canopy.mismatch)
    log_ratio = torch.where(mask, old - inputs["engine_logprobs"], 0.0)
    row_sums = sum_over_context(torch.stack([log_ratio.sum(-1), mask.sum(-1).to(log_ratio.dtype)]), cp_mesh)
    sequence_ratio, has_actions = sequence_log_ratio(row_sums[0], row_sums[1])
    # w: all ones unless a rollout correction is on
    pg_weights, changed = correction.weights(log_ratio, sequence_ratio)
    # off the action tokens (padding included) the KL term is exactly 0, never 0 x inf
    ref = torch.where(mask, inputs["ref_logprobs"], logprobs.detach())
    loss, metrics = canopy_loss(
        logprobs,
        old,
        ref,
        advantages,
        mask,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        kl_coef=a.kl_coef,
        aggregation=a.loss_aggregation,
        num_action_tokens=pooled.tokens,
        num_sequences=pooled.sequences,
        pg_weights=pg_weights,
    )
    token_entropy = (entropy * mask).sum() / max(1, pooled.tokens)
    if a.entropy_coef:
        loss = loss - a.entropy_coef * token_entropy
    metrics = {f"actor/{k}": v for k, v in metrics.items()}
    metrics.update({"actor/loss": loss.detach(), "actor/entropy": token_entropy.detach()})
    share = pooled.sequence_share
    metrics.update(mismatch_metrics(log_ratio, mask, sequence_ratio, has_actions, pooled.tokens, share))
    metrics.update(correction_metrics(correction, pg_weights, changed, mask, has_actions, pooled.tokens, share))
    return loss, metrics
