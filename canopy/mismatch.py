"""Engine-trainer mismatch (docs/on_policy.md): how far the engine's sampling
distribution mu is from the trainer's pi_theta on the sampled tokens, the bounds a run holds it to, and the
opt-in corrections of the policy-gradient term for it (`algorithm.rollout_correction`).

With one update per rollout batch the trainer's ratio pi_theta / pi_old of Eq. 6 is 1 by construction. What is
left is mu != pi_old: inference kernels, bf16, or a stale or partial weight sync. On every action token

    r_t = log pi_old(o_t) - log mu(o_t),    rho_t = exp(r_t)

with pi_old the trainer's logprobs before the update. A correction multiplies the clipped surrogate S_t of Eq. 7
by a detached weight w_t; the k3 anchor and Eq. 8's N are left as they are:

    none           w = 1                                   the paper's recipe
    token_tis      w = min(rho, C)                         truncated importance sampling
    token_mask     w = rho * 1[low <= rho <= high]         IcePop: importance weight, tokens off the band masked
    sequence_mask  w = 1[low <= exp(mean_t r_t) <= high]   geometric-mean ratio: a whole sequence kept or masked
"""

from dataclasses import dataclass

import torch

from canopy.errors import require

CORRECTIONS = ("none", "token_tis", "token_mask", "sequence_mask")


class OffPolicyError(RuntimeError):
    """Strict on-policy training cannot go on: tokens sampled by other weights, or an engine-trainer gap beyond
    its bound (the engine does not sample from the weights the trainer learns from)."""


@dataclass(frozen=True)
class RolloutCorrection:
    """`algorithm.rollout_correction`: which weight multiplies S_t (module docstring), and its bounds; the schema and
    the only defaults of those keys. Opt-in: off in the recipe."""

    mode: str = "none"  # none | token_tis | token_mask (IcePop) | sequence_mask (geometric)
    tis_cap: float = 2.0  # token_tis: w = min(rho, C)
    token_bounds: tuple[float, float] = (0.5, 5.0)  # token_mask: IcePop's [alpha, beta]: w = rho inside, 0 outside
    sequence_bounds: tuple[float, float] = (0.99, 1.01)  # sequence_mask: keep a sequence iff its geometric-mean rho
    # is inside

    def validate(self) -> None:
        key = "algorithm.rollout_correction"
        require(self.mode in CORRECTIONS, f"{key}.mode={self.mode!r} is unknown: use one of {', '.join(CORRECTIONS)}")
        require(self.tis_cap > 0, f"{key}.tis_cap={self.tis_cap} must be > 0 (slime uses 2)")
        for name, (low, high) in (("token_bounds", self.token_bounds), ("sequence_bounds", self.sequence_bounds)):
            require(0 <= low <= 1 <= high, f"{key}.{name}=[{low}, {high}] must satisfy 0 <= low <= 1 <= high")

    def weights(self, log_ratio: torch.Tensor, sequence_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w, changed), both [B, T]: the weight of each token's S_t and where the correction truncated or masked
        it. `log_ratio` is r, [B, T]; `sequence_ratio` is mean_t r_t over each sequence's action tokens, [B]."""
        rho = log_ratio.exp()
        if self.mode == "none":
            return torch.ones_like(rho), torch.zeros_like(rho, dtype=torch.bool)
        if self.mode == "token_tis":
            changed = rho > self.tis_cap
            return rho.clamp(max=self.tis_cap), changed
        if self.mode == "token_mask":
            low, high = self.token_bounds
            changed = (rho < low) | (rho > high)
            return torch.where(changed, 0.0, rho), changed
        low, high = self.sequence_bounds
        geometric = sequence_ratio.exp()
        changed = ((geometric < low) | (geometric > high))[:, None].expand_as(rho)
        return (~changed).to(rho.dtype), changed


def sequence_log_ratio(token_sums: torch.Tensor, token_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean_t r_t, has action tokens) of each sequence, [B] each, from its sum of r and its action-token count
    (over the whole sequence: under context parallelism, summed over the CP ranks first)."""
    return token_sums / token_counts.clamp_min(1), token_counts > 0


def mismatch_metrics(
    log_ratio: torch.Tensor,
    action_mask: torch.Tensor,
    sequence_ratio: torch.Tensor,
    has_actions: torch.Tensor,
    num_action_tokens: float,
    num_sequences: float,
) -> dict[str, torch.Tensor]:
    """Sums of one micro-batch's share of the step's mismatch metrics: token metrics divided by the step's action
    tokens N, sequence metrics by its sequences, so that they add up exactly over micro-batches and ranks.

    logprob_gap: mean |r| per action token (what the audit bounds); kl: k3 estimate of KL(mu || pi_old) per token,
    exp(r) - 1 - r, its samples being mu's; seq_log_ratio / seq_abs_log_ratio: mean over sequences of mean_t r_t
    (signed: which way the engine leans) and of its absolute value."""
    mask = action_mask.to(log_ratio.dtype)
    rows = has_actions.to(log_ratio.dtype)
    tokens, sequences = max(1.0, num_action_tokens), max(1.0, num_sequences)
    return {
        "mismatch/logprob_gap": (log_ratio.abs() * mask).sum() / tokens,
        "mismatch/kl": ((log_ratio.exp() - 1 - log_ratio) * mask).sum() / tokens,
        "mismatch/seq_log_ratio": (sequence_ratio * rows).sum() / sequences,
        "mismatch/seq_abs_log_ratio": (sequence_ratio.abs() * rows).sum() / sequences,
    }


def correction_metrics(
    correction: RolloutCorrection,
    weights: torch.Tensor,
    changed: torch.Tensor,
    action_mask: torch.Tensor,
    has_actions: torch.Tensor,
    num_action_tokens: float,
    num_sequences: float,
) -> dict[str, torch.Tensor]:
    """Sums of one micro-batch's share of the correction's metrics (normalized as in `mismatch_metrics`): the mean
    weight per action token, and the fraction of action tokens truncated (token_tis) or masked (token_mask), or of
    sequences masked (sequence_mask). Nothing when no correction is on."""
    if correction.mode == "none":
        return {}
    mask = action_mask.to(weights.dtype)
    tokens, sequences = max(1.0, num_action_tokens), max(1.0, num_sequences)
    metrics = {"correction/weight_mean": (weights * mask).sum() / tokens}
    if correction.mode == "token_tis":
        metrics["correction/truncated_frac"] = (changed * mask).sum() / tokens
    elif correction.mode == "token_mask":
        metrics["correction/masked_token_frac"] = (changed * mask).sum() / tokens
    else:
        masked_rows = changed[:, 0] & has_actions  # the sequence mask changes whole rows
        metrics["correction/masked_seq_frac"] = masked_rows.to(weights.dtype).sum() / sequences
    return metrics


@dataclass
class GapBounds:
    """Bounds on `mismatch/logprob_gap` for one engine and serving dtype (`engine.gap_bounds.<dtype>`): `parity`
    on the first update of a run, before the policy moved (the engine and the trainer load the same checkpoint);
    `warn` and `stop` on every update after it."""

    parity: float
    warn: float
    stop: float

    def validate(self, where: str) -> None:
        require(
            0 < self.parity and 0 < self.warn <= self.stop,
            f"{where}={{parity: {self.parity}, warn: {self.warn}, stop: {self.stop}}}: need parity > 0 and "
            "0 < warn <= stop",
        )
