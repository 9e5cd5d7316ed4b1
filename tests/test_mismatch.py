"""Engine-trainer mismatch metrics and the opt-in rollout corrections (canopy/mismatch.py) against hand values."""

import math

import pytest
import torch

from canopy.errors import ConfigError
from canopy.mismatch import (
    GapBounds,
    RolloutCorrection,
    correction_metrics,
    mismatch_metrics,
    sequence_log_ratio,
)
from canopy.objective import token_objective

# two sequences; rho = pi_old / mu on each action token (M = 1); r = log rho, 0 off the action tokens
MASK = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
RHO = torch.tensor([[3.0, 0.25, 1.0, 1.0], [1.0, 1.005, 0.995, 1.0]], dtype=torch.float64)
LOG_RATIO = torch.where(MASK, RHO.log(), 0.0)
N_TOKENS, N_SEQUENCES = 5.0, 2.0


def sequences(log_ratio=LOG_RATIO, mask=MASK):
    return sequence_log_ratio(log_ratio.sum(-1), mask.sum(-1).to(log_ratio.dtype))


def corrected(mode: str, **bounds):
    correction = RolloutCorrection(mode, **bounds)
    ratio, has_actions = sequences()
    weights, changed = correction.weights(LOG_RATIO, ratio)
    metrics = correction_metrics(correction, weights, changed, MASK, has_actions, N_TOKENS, N_SEQUENCES)
    return weights * MASK, {k: float(v) for k, v in metrics.items()}


def test_mismatch_metrics_by_hand():
    ratio, has_actions = sequences()
    row0, row1 = math.log(0.75) / 3, (math.log(1.005) + math.log(0.995)) / 2
    assert ratio.tolist() == pytest.approx([row0, row1]) and has_actions.tolist() == [True, True]
    metrics = {k: float(v) for k, v in mismatch_metrics(LOG_RATIO, MASK, ratio, has_actions, 5, 2).items()}
    rhos = [3.0, 0.25, 1.0, 1.005, 0.995]
    assert metrics["mismatch/logprob_gap"] == pytest.approx(sum(abs(math.log(r)) for r in rhos) / 5)
    assert metrics["mismatch/kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in rhos) / 5)
    assert metrics["mismatch/seq_log_ratio"] == pytest.approx((row0 + row1) / 2)
    assert metrics["mismatch/seq_abs_log_ratio"] == pytest.approx((abs(row0) + abs(row1)) / 2)


def test_no_correction_leaves_every_weight_at_one_and_logs_nothing():
    weights, metrics = corrected("none")
    assert torch.equal(weights, MASK.to(weights.dtype)) and metrics == {}


def test_token_tis_truncates_at_the_cap():
    weights, metrics = corrected("token_tis", tis_cap=2.0)
    assert torch.allclose(weights, torch.tensor([[2.0, 0.25, 1.0, 0.0], [0.0, 1.005, 0.995, 0.0]], dtype=torch.float64))
    assert metrics == pytest.approx({"correction/weight_mean": 5.25 / 5, "correction/truncated_frac": 1 / 5})


def test_token_mask_keeps_the_importance_weight_inside_the_band_and_masks_outside():
    weights, metrics = corrected("token_mask", token_bounds=(0.5, 5.0))
    assert torch.allclose(weights, torch.tensor([[3.0, 0.0, 1.0, 0.0], [0.0, 1.005, 0.995, 0.0]], dtype=torch.float64))
    assert metrics == pytest.approx({"correction/weight_mean": 6.0 / 5, "correction/masked_token_frac": 1 / 5})


def test_sequence_mask_drops_whole_sequences_by_their_geometric_mean_ratio():
    # row 0: (3 x 0.25 x 1)^(1/3) = 0.909 is outside [0.99, 1.01]; row 1: (1.005 x 0.995)^(1/2) = 0.99999 inside
    weights, metrics = corrected("sequence_mask", sequence_bounds=(0.99, 1.01))
    assert weights.tolist() == [[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
    assert metrics == pytest.approx({"correction/weight_mean": 2 / 5, "correction/masked_seq_frac": 1 / 2})
    weights, _ = corrected("sequence_mask", sequence_bounds=(0.9, 1.1))
    assert torch.equal(weights, MASK.to(weights.dtype))


@pytest.mark.parametrize("mode", ["none", "token_tis", "token_mask", "sequence_mask"])
def test_metrics_add_up_over_micro_batches(mode):
    """Each micro-batch divides by the step's N and sequence count, so the parts sum to the whole."""
    correction = RolloutCorrection(mode, tis_cap=2.0)

    def metrics(rows):
        ratio, has_actions = sequences(LOG_RATIO[rows], MASK[rows])
        weights, changed = correction.weights(LOG_RATIO[rows], ratio)
        return {
            **mismatch_metrics(LOG_RATIO[rows], MASK[rows], ratio, has_actions, N_TOKENS, N_SEQUENCES),
            **correction_metrics(correction, weights, changed, MASK[rows], has_actions, N_TOKENS, N_SEQUENCES),
        }

    whole, first, second = metrics([0, 1]), metrics([0]), metrics([1])
    for key in whole:
        assert float(first[key] + second[key]) == pytest.approx(float(whole[key])), key


def test_correction_weights_multiply_the_surrogate_only():
    """-w * S + beta * k3: the weight scales the clipped surrogate, the KL anchor is untouched, no gradient flows
    through w."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old, ref = logprobs.detach(), torch.tensor([[-1.5, -1.0]])
    advantages = torch.tensor([2.0])
    weights = torch.tensor([[3.0, 0.0]], requires_grad=True)
    plain = token_objective(logprobs, old, ref, advantages, clip_low=0.2, clip_high=0.2, kl_coef=0.5)
    weighted = token_objective(
        logprobs, old, ref, advantages, clip_low=0.2, clip_high=0.2, kl_coef=0.5, pg_weights=weights
    )
    k3 = plain["kl"].detach()
    assert plain["term"].detach()[0].tolist() == pytest.approx((-2.0 + 0.5 * k3)[0].tolist())
    assert weighted["term"].detach()[0].tolist() == pytest.approx([-6.0 + 0.5 * k3[0, 0].item(), 0.5 * k3[0, 1].item()])
    weighted["term"].sum().backward()
    assert weights.grad is None


def test_bad_correction_and_bounds_are_config_errors():
    with pytest.raises(ConfigError, match="mode='tis' is unknown: use one of none, token_tis"):
        RolloutCorrection("tis").validate()
    with pytest.raises(ConfigError, match="tis_cap=0 must be > 0"):
        RolloutCorrection("token_tis", tis_cap=0).validate()
    with pytest.raises(ConfigError, match=r"token_bounds=\[1.5, 5.0\] must satisfy 0 <= low <= 1 <= high"):
        RolloutCorrection("token_mask", token_bounds=(1.5, 5.0)).validate()
    with pytest.raises(ConfigError, match=r"engine.gap_bounds.bfloat16=.*need parity > 0 and 0 < warn <= stop"):
        GapBounds(parity=0.03, warn=0.2, stop=0.1).validate("engine.gap_bounds.bfloat16")
