"""Signal coverage under a sparse reward (Section 3.2, Eqs. 4-5)."""

import math


def signal_coverage(p: float, n: int) -> float:
    """P_sig(p, n) = 1 - p^n - (1-p)^n: probability that a group of n rollouts mixes outcomes (Eq. 4)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"success rate p={p} must lie in [0, 1]")
    if n < 1:
        raise ValueError(f"group size n={n} must be at least 1")
    return 1.0 - p**n - (1.0 - p) ** n


def group_size_for_coverage(p_min: float, tau: float) -> int:
    """Smallest n with 1 - (1-p_min)^n >= tau: n = ceil(ln(1-tau) / ln(1-p_min)) (Eq. 5).

    A first-order floor, not an optimum: it treats rollouts as independent and p_min as a point estimate.
    """
    if not 0.0 < p_min < 1.0:
        raise ValueError(f"p_min={p_min} must lie strictly between 0 and 1 (a pilot rate of 0 needs more rollouts)")
    if not 0.0 < tau < 1.0:
        raise ValueError(f"target coverage tau={tau} must lie strictly between 0 and 1")
    ratio = math.log(1.0 - tau) / math.log(1.0 - p_min)
    # guard against float noise such as 44.00000000000001 -> 45
    return max(1, math.ceil(round(ratio, 9)))


def group_composition(successes: int, n: int) -> str:
    """Classify a group as 'all_fail', 'all_success' or 'mixed' (the informative case)."""
    if successes == 0:
        return "all_fail"
    if successes == n:
        return "all_success"
    return "mixed"
