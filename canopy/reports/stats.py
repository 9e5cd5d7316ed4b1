"""Statistics over training seeds for the paper checks (`bench/paper_checks.py`): a mean with its 95% percentile
bootstrap interval, and the same for a variant's difference to the recipe, paired by seed.

With few seeds the percentile bootstrap is crude (three seeds give at most ten distinct resampled means, and the
interval never reaches past the observed extremes), so `describe` reports the seeds' count beside each interval:
an interval over three seeds says where the runs fell, not where a fourth would.
"""

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds and its bootstrap interval."""

    mean: float
    low: float
    high: float
    seeds: int

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def bootstrap_mean(values: list[float], confidence: float = 0.95, resamples: int = 10_000, seed: int = 0) -> Estimate:
    """The mean of `values` and its percentile bootstrap interval: resample the values with replacement
    `resamples` times and take the (1 - confidence)/2 and (1 + confidence)/2 quantiles of the resampled means."""
    if not values:
        raise ValueError("bootstrap_mean needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    rng = random.Random(seed)
    size = len(values)
    means = sorted(sum(rng.choices(values, k=size)) / size for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = means[int(tail * (resamples - 1))]
    high = means[int(round((1 - tail) * (resamples - 1)))]
    return Estimate(sum(values) / size, low, high, size)


def paired_difference(variant: dict[int, float], reference: dict[int, float], **kwargs) -> Estimate:
    """The variant's mean difference to the reference over the seeds both ran (each seed's own difference, so
    what a seed shares, its task order and initial samples, cancels), with its bootstrap interval."""
    seeds = sorted(set(variant) & set(reference))
    if not seeds:
        raise ValueError("no seed ran in both the variant and the reference")
    return bootstrap_mean([variant[s] - reference[s] for s in seeds], **kwargs)


def describe(estimate: Estimate, scale: float = 100.0, digits: int = 1, signed: bool = False) -> str:
    """`mean [low, high]`, scaled (percent by default)."""
    form = f"{'+' if signed else ''}.{digits}f"
    return f"{scale * estimate.mean:{form}} [{scale * estimate.low:{form}}, {scale * estimate.high:{form}}]"
