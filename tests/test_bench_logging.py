"""bench/logging_overhead.py's end-to-end estimate: a run-wide speed difference between the two runs cancels."""

import math
from types import SimpleNamespace

import pytest

from bench.logging_overhead import block_log_ratios, logging_on, pair_estimate


def test_blocks_alternate_in_opposite_phase():
    first = [logging_on(step, 3, True) for step in range(12)]
    assert first == [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3
    assert [logging_on(step, 3, False) for step in range(12)] == [not on for on in first]


@pytest.mark.parametrize("machine", [1.0, 1.3, 0.7])  # the second run on a machine this much slower (or faster)
def test_the_logging_cost_is_recovered_whatever_the_runs_own_speeds(machine):
    args = SimpleNamespace(skip=4, block=4)
    work = {step: 0.5 + 0.1 * (step % 5) for step in range(40)}  # steps differ in work, alike in both runs
    cost = 1.05

    def run(first_on: bool, speed: float) -> dict[int, float]:
        return {s: w * speed * (cost if logging_on(s, args.block, first_on) else 1.0) for s, w in work.items()}

    phases = block_log_ratios(run(True, 1.0), run(False, machine), args)
    assert [len(phases[True]), len(phases[False])] == [4, 5]  # blocks 2 4 6 8 and 1 3 5 7 9: unbalanced
    estimate, variance = pair_estimate(phases)
    assert math.exp(estimate) == pytest.approx(cost) and variance == pytest.approx(0.0, abs=1e-12)
    pooled = [r for values in phases.values() for r in values]  # one mean over all blocks would keep 1/9 of it
    assert math.exp(sum(pooled) / len(pooled)) == pytest.approx(cost * machine ** (1 / 9))
