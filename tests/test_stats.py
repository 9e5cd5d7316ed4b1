"""The paper checks' statistics over seeds: bootstrap intervals of a mean and of a paired difference."""

import random

import pytest

from canopy.reports.stats import Estimate, bootstrap_mean, describe, paired_difference


def test_the_interval_holds_the_mean_inside_the_observed_range():
    values = [0.2, 0.5, 0.9, 0.4]
    estimate = bootstrap_mean(values)
    assert estimate.mean == pytest.approx(0.5) and estimate.seeds == 4
    assert min(values) <= estimate.low < estimate.mean < estimate.high <= max(values)
    flat = bootstrap_mean([0.7, 0.7, 0.7])
    assert (flat.low, flat.mean, flat.high) == pytest.approx((0.7, 0.7, 0.7))  # no spread, no width


def test_the_95_percent_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = random.Random(1)
    covered = 0
    for trial in range(300):
        sample = [rng.gauss(0.0, 1.0) for _ in range(30)]
        estimate = bootstrap_mean(sample, resamples=1000, seed=trial)
        covered += estimate.low <= 0.0 <= estimate.high
    assert 0.88 <= covered / 300 <= 0.99  # the percentile bootstrap runs a little narrow at n = 30


def test_a_wider_confidence_gives_a_wider_interval_and_more_data_a_narrower_one():
    rng = random.Random(2)
    small = [rng.random() for _ in range(5)]
    large = small + [rng.random() for _ in range(95)]
    width = lambda e: e.high - e.low  # noqa: E731
    assert width(bootstrap_mean(small, confidence=0.99)) > width(bootstrap_mean(small, confidence=0.5))
    assert width(bootstrap_mean(large)) < width(bootstrap_mean(small))


def test_pairing_by_seed_separates_a_small_effect_from_large_seed_to_seed_variation():
    rng = random.Random(3)
    seed_effect = {seed: rng.uniform(0.0, 0.6) for seed in range(6)}  # a seed's own luck, shared by both variants
    reference = {seed: seed_effect[seed] + 0.3 for seed in seed_effect}
    variant = {seed: seed_effect[seed] + 0.25 + rng.uniform(-0.01, 0.01) for seed in seed_effect}
    paired = paired_difference(variant, reference)
    assert paired.mean == pytest.approx(-0.05, abs=0.01) and paired.excludes_zero() and paired.high < 0
    unpaired_variant, unpaired_reference = (
        bootstrap_mean(list(variant.values())),
        bootstrap_mean(list(reference.values())),
    )
    assert unpaired_variant.high > unpaired_reference.low  # apart, the two intervals overlap: no conclusion
    assert paired_difference({0: 0.5, 1: 0.6, 9: 0.1}, {0: 0.4, 1: 0.4}).seeds == 2  # only the seeds both ran


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_mean([])
    with pytest.raises(ValueError, match="confidence=1.5 must be in"):
        bootstrap_mean([1.0], confidence=1.5)
    with pytest.raises(ValueError, match="no seed ran in both"):
        paired_difference({0: 1.0}, {1: 1.0})


def test_describe_writes_percent_with_the_interval():
    assert describe(Estimate(0.5, 0.25, 0.755, 3)) == "50.0 [25.0, 75.5]"
    assert describe(Estimate(-0.05, -0.1, 0.02, 3), signed=True) == "-5.0 [-10.0, +2.0]"
    assert describe(Estimate(0.1234, 0.1, 0.2, 3), scale=1.0, digits=3) == "0.123 [0.100, 0.200]"
