"""Signal coverage under a sparse reward (Section 3.2, Eqs. 4-5)."""

import heapq
import math
from dataclasses import dataclass

from canopy.errors import is_int, require


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


def mixing_gain(p: float, n: int) -> float:
    """P_sig(p, n + 1) - P_sig(p, n) = p^n (1-p) + (1-p)^n p: what one more rollout adds to a group's chance of mixing
    outcomes (Eq. 4). It falls as n grows, and is small both for a task that always succeeds and one that never does."""
    return p**n * (1.0 - p) + (1.0 - p) ** n * p


def allocate_rollouts(rates: list[float], budget: int, floor: int, cap: int) -> list[int]:
    """A step's `budget` rollouts split over its tasks (running success estimates `rates`) to maximize the expected
    number of mixed groups, sum_i P_sig(p_i, n_i) (Eq. 4), each n_i between `floor` and `cap`: every task starts at
    the floor, then each further rollout goes to the task it helps most (`mixing_gain`). Greedy is optimal here,
    since each task's gain falls with its n. A task far below the others (p << 1/cap) keeps the floor: Eq. 5 would
    want more rollouts for it than the cap allows, and they would mostly all fail."""
    if not len(rates) * floor <= budget <= len(rates) * cap:
        raise ValueError(f"{budget} rollouts cannot give {len(rates)} tasks between {floor} and {cap} each")
    counts = [floor] * len(rates)
    heap = [(-mixing_gain(p, floor), i) for i, p in enumerate(rates) if floor < cap]
    heapq.heapify(heap)
    for _ in range(budget - floor * len(rates)):
        _, i = heapq.heappop(heap)  # the largest gain; ties to the first task
        counts[i] += 1
        if counts[i] < cap:
            heapq.heappush(heap, (-mixing_gain(rates[i], counts[i]), i))
    return counts


@dataclass
class AdaptiveGroupSettings:
    """`algorithm.adaptive_group.*`, read with `algorithm.group_size=auto`: the schema (conf/train.yaml holds the
    defaults and says what each key means)."""

    mean: int
    floor: int
    cap: int
    decay: float

    def validate(self) -> None:
        require(
            all(is_int(v) for v in (self.floor, self.mean, self.cap)) and 2 <= self.floor <= self.mean <= self.cap,
            f"algorithm.adaptive_group floor={self.floor} / mean={self.mean} / cap={self.cap}: need integers with "
            "2 <= floor <= mean <= cap",
        )
        require(0 <= self.decay <= 1, f"algorithm.adaptive_group.decay={self.decay} must lie in [0, 1]")


class SuccessEstimates:
    """Each task's running success rate for `algorithm.group_size=auto`: its own groups' outcomes, each older visit
    discounted by `decay` (the policy moves), shrunk toward its tier's pooled rate by a prior worth `prior_weight`
    rollouts, so that an unseen or all-fail task is never at p = 0. A tier seen nowhere yet is at 1/2 (the first
    step then splits its rollouts evenly: the pilot)."""

    def __init__(self, decay: float = 0.5, prior_weight: float = 2.0):
        self.decay, self.prior_weight = decay, prior_weight
        self.tasks: dict[str, list[float]] = {}  # task id -> [discounted successes, discounted rollouts]
        self.tiers: dict[int, list[float]] = {}

    def observe(self, task_id: str, tier: int, successes: int, rollouts: int) -> None:
        """A scored group of the task: `successes` of its `rollouts` (quarantined episodes left out)."""
        for table, key in ((self.tasks, task_id), (self.tiers, tier)):
            s, n = table.get(key, (0.0, 0.0))
            table[key] = [self.decay * s + successes, self.decay * n + rollouts]

    def rate(self, task_id: str, tier: int) -> float:
        s, n = self.tiers.get(tier, (0.0, 0.0))
        tier_rate = (s + 0.5) / (n + 1.0)
        s, n = self.tasks.get(task_id, (0.0, 0.0))
        return (s + self.prior_weight * tier_rate) / (n + self.prior_weight)

    def state_dict(self) -> dict:
        return {"tasks": self.tasks, "tiers": {str(k): v for k, v in self.tiers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.tasks = {k: list(v) for k, v in state["tasks"].items()}
        self.tiers = {int(k): list(v) for k, v in state["tiers"].items()}
