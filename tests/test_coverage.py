import math

import pytest

from canopy.coverage import group_composition, group_size_for_coverage, signal_coverage


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
