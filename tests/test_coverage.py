import itertools
import json
import math
import random

import pytest

from canopy.coverage import (
    SuccessEstimates,
    allocate_rollouts,
    group_composition,
    group_size_for_coverage,
    mixing_gain,
    signal_coverage,
)


def test_signal_coverage_matches_figure_2():
    # Section 3.2 / Fig. 2a: a hard task (p = 0.05) goes from 34% coverage at n = 8 to 81% at n = 32.
    assert signal_coverage(0.05, 8) == pytest.approx(0.3366, abs=1e-4)
    assert signal_coverage(0.05, 32) == pytest.approx(0.8063, abs=1e-4)


def test_signal_coverage_hand_values_and_extremes():
    assert signal_coverage(0.5, 2) == pytest.approx(0.5)  # 1 - 1/4 - 1/4
    assert signal_coverage(0.2, 3) == pytest.approx(1 - 0.008 - 0.512)
    assert signal_coverage(0.0, 32) == 0.0
    assert signal_coverage(1.0, 32) == 0.0
    assert signal_coverage(0.3, 1) == pytest.approx(0.0)
    # symmetric in p <-> 1-p, maximal at 1/2
    assert signal_coverage(0.1, 16) == pytest.approx(signal_coverage(0.9, 16))
    assert signal_coverage(0.5, 16) > signal_coverage(0.4, 16)


def test_group_size_for_coverage_eq5():
    # ceil(ln(0.2) / ln(0.95)) = ceil(31.38) = 32: the paper's n for a p ~ 0.05 tier at 80% coverage
    assert group_size_for_coverage(0.05, 0.8) == 32
    assert group_size_for_coverage(0.5, 0.75) == 2  # ln(.25)/ln(.5) = 2 exactly, no float creep to 3
    assert group_size_for_coverage(0.1, 0.9) == math.ceil(math.log(0.1) / math.log(0.9))
    n = group_size_for_coverage(0.02, 0.9)
    assert 1 - 0.98**n >= 0.9 > 1 - 0.98 ** (n - 1)


@pytest.mark.parametrize("p_min,tau", [(0.0, 0.8), (1.0, 0.8), (0.1, 0.0), (0.1, 1.0)])
def test_group_size_rejects_degenerate_inputs(p_min, tau):
    with pytest.raises(ValueError):
        group_size_for_coverage(p_min, tau)


def test_signal_coverage_rejects_bad_inputs():
    with pytest.raises(ValueError):
        signal_coverage(1.5, 4)
    with pytest.raises(ValueError):
        signal_coverage(0.5, 0)


def test_group_composition():
    assert group_composition(0, 8) == "all_fail"
    assert group_composition(8, 8) == "all_success"
    assert group_composition(3, 8) == "mixed"


def test_allocation_maximizes_expected_mixed_groups_by_hand():
    """Each rollout past the floor goes to the largest gain P_sig(p, n+1) - P_sig(p, n) = p^n (1-p) + (1-p)^n p.
    From [2, 2] at p = (0.5, 0.1): gains 0.25 vs 0.09 -> [3, 2]; 0.125 vs 0.09 -> [4, 2]; 0.0625 vs 0.09 -> [4, 3];
    0.0625 vs 0.0738 -> [4, 4]."""
    assert mixing_gain(0.5, 2) == 0.25 and mixing_gain(0.1, 3) == pytest.approx(0.001 * 0.9 + 0.729 * 0.1)
    assert [allocate_rollouts([0.5, 0.1], budget, floor=2, cap=8) for budget in (4, 5, 6, 7, 8)] == [
        [2, 2],
        [3, 2],
        [4, 2],
        [4, 3],
        [4, 4],
    ]
    assert allocate_rollouts([0.5, 0.1], budget=16, floor=2, cap=8)[1] == 8  # capped
    with pytest.raises(ValueError, match="cannot give 3 tasks between 4 and 8"):
        allocate_rollouts([0.1, 0.2, 0.3], budget=10, floor=4, cap=8)


def test_a_task_far_below_the_others_keeps_the_floor():
    """Issue 32: with Eq. 5's sizes split in proportion, a near-impossible task (p = 0.001: Eq. 5 wants 2,302 at
    tau = 0.9) took most of the step, mostly all-fail, and left the learnable tasks at the floor of 4."""
    sizes = allocate_rollouts([0.001] + [0.25] * 7, budget=128, floor=4, cap=128)
    assert sizes[0] == 4 and sum(sizes) == 128 and min(sizes[1:]) >= 17
    expected = sum(signal_coverage(p, n) for p, n in zip([0.001] + [0.25] * 7, sizes))
    old = sum(signal_coverage(p, n) for p, n in zip([0.001] + [0.25] * 7, [100] + [4] * 7))
    assert expected > 6.9 and old < 5.0  # expected mixed groups out of 8


@pytest.mark.parametrize("seed", range(20))
def test_allocation_is_optimal_and_meets_its_bounds(seed):
    """Greedy equals the best split found by brute force (small cases), and always meets floor, cap and budget."""
    rng = random.Random(seed)
    k, floor, cap = rng.randint(1, 3), rng.randint(2, 4), rng.randint(5, 9)
    rates = [rng.uniform(0.01, 0.99) for _ in range(k)]
    budget = rng.randint(k * floor, k * cap)
    sizes = allocate_rollouts(rates, budget, floor, cap)
    assert sum(sizes) == budget and all(floor <= n <= cap for n in sizes)
    value = lambda ns: sum(signal_coverage(p, n) for p, n in zip(rates, ns))  # noqa: E731
    best = max(value(ns) for ns in itertools.product(range(floor, cap + 1), repeat=k) if sum(ns) == budget)
    assert value(sizes) == pytest.approx(best, abs=1e-12)


def test_success_estimates_shrink_discount_and_resume():
    estimates = SuccessEstimates(decay=0.5, prior_weight=2.0)
    assert estimates.rate("a", 3) == 0.5  # nothing seen: the pilot's even split
    estimates.observe("a", 3, successes=0, rollouts=16)
    assert estimates.rate("a", 3) == pytest.approx((0 + 2 * 0.5 / 17) / 18)  # all-fail, yet above 0
    assert estimates.rate("b", 3) == pytest.approx(0.5 / 17)  # an unseen task of the tier: the tier's rate
    estimates.observe("a", 3, successes=8, rollouts=8)
    tier = (8 + 0.5) / (16 * 0.5 + 8 + 1)
    assert estimates.rate("a", 3) == pytest.approx((8 + 2 * tier) / (8 + 8 + 2))  # the older visit counts half
    resumed = SuccessEstimates(decay=0.5, prior_weight=2.0)
    resumed.load_state_dict(json.loads(json.dumps(estimates.state_dict())))
    assert resumed.rate("a", 3) == estimates.rate("a", 3) and resumed.rate("c", 1) == estimates.rate("c", 1)


def test_group_sizes_replays_where_a_runs_rollouts_went(tmp_path, capsys):
    """`python -m canopy.tools.group_sizes`: per step and tier the rollouts, successes and mixed groups from the
    trajectory logs, and each task's estimate before the step, replayed as group_size=auto computed it."""
    import gzip

    from canopy.tools.group_sizes import main, replay

    def episode(group, task, tier, passed, quarantine=None):
        verdict = None if quarantine else {"passed": passed, "total": 2, "success": passed == 2}
        return {"group": group, "task_id": task, "tier": tier, "verdict": verdict, "quarantine": quarantine}

    steps = {
        0: [
            episode(0, "a", 1, 2),
            episode(0, "a", 1, 0),
            episode(1, "b", 3, 1),
            episode(1, "b", 3, 0, "worker_killed"),
        ],
        1: [episode(0, "b", 3, 2), episode(0, "b", 3, 2), episode(0, "b", 3, 0)],
    }
    folder = tmp_path / "trajectories" / "train"
    folder.mkdir(parents=True)
    for step, records in steps.items():
        with gzip.open(folder / f"step_{step:06d}.jsonl.gz", "wt") as out:
            out.write("".join(json.dumps(r) + "\n" for r in records))
    first, second = replay(tmp_path, decay=0.5)
    assert first["tiers"] == {
        1: {"rollouts": 2, "successes": 1, "groups": 1, "mixed": 1},
        3: {"rollouts": 1, "successes": 0, "groups": 1, "mixed": 0},  # the quarantined episode left out
    }
    assert [g["estimate"] for g in first["groups"]] == [0.5, 0.5]  # nothing seen yet: the pilot's even split
    estimates = SuccessEstimates(decay=0.5)
    estimates.observe("a", 1, 1, 2)
    estimates.observe("b", 3, 0, 1)
    assert second["groups"] == [{"task": "b", "tier": 3, "estimate": estimates.rate("b", 3), "n": 3, "successes": 2}]
    main([str(tmp_path), "--every", "1", "--tasks"])
    printed = capsys.readouterr().out
    assert "step    1  tier3:   3 rollouts,   2 successes, 1/1 mixed" in printed and "note:" not in printed
    (folder / "step_000001.jsonl.gz").rename(folder / "step_000003.jsonl.gz")
    main([str(tmp_path)])
    assert "some training steps were not logged" in capsys.readouterr().out
