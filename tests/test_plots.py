"""Every figure renders: a non-empty PNG of the expected size (figsize x DPI)."""

import matplotlib.pyplot as plt
import pytest
from torch.utils.tensorboard import SummaryWriter

from canopy.reports.plots import (
    DPI,
    plot_budget_transfer,
    plot_check_bars,
    plot_check_curves,
    plot_coverage,
    plot_drift,
    plot_group_composition,
    training_plots,
)
from canopy.reports.stats import Estimate

SERIES = {
    "reward/success": [(s, 0.3 + 0.06 * s) for s in range(10)],
    "actor/entropy": [(s, 1.0 - 0.05 * s) for s in range(10)],
    "actor/kl": [(s, 0.01 * s) for s in range(10)],
    "eval/training_budget/tgc_all": [(5, 0.5), (10, 0.8)],
    **{
        f"coverage/{kind}": [(s, v) for s in range(10)]
        for kind, v in (("all_fail", 0.2), ("mixed", 0.5), ("all_success", 0.3))
    },
    **{f"success/tier{t}": [(s, 0.1 * t) for s in range(10)] for t in (1, 2, 3)},
    **{f"coverage/mixed_tier{t}": [(s, 0.5) for s in range(10)] for t in (1, 2, 3)},
    **{f"coverage/psig_tier{t}": [(s, 0.6) for s in range(10)] for t in (1, 2, 3)},
}
RESULT = {
    "policy": "final",
    "budget": "embedded (5t/256)",
    "split": "dev",
    "k": 4,
    "metrics": {
        "all": {"tgc_mean": 0.6},
        "tier1": {"tgc_mean": 0.9},
        "tier2": {"tgc_mean": 0.6},
        "tier3": {"tgc_mean": 0.2},
    },
}


def assert_png(path, width_in, height_in):
    image = plt.imread(path)
    assert path.stat().st_size > 5_000
    assert image.shape[:2] == (round(height_in * DPI), round(width_in * DPI))
    assert image[..., :3].std() > 0.01  # not a blank canvas


def test_figures_render(tmp_path):
    assert_png(plot_coverage(tmp_path / "f2.png", 16, {"tier3": 0.05}), 10, 3.8)
    assert_png(plot_group_composition(SERIES, tmp_path / "f3.png"), 10, 3.8)
    assert_png(plot_drift({"recipe": SERIES, "no_kl": SERIES}, tmp_path / "f4.png"), 10, 3.8)
    enlarged = {**RESULT, "budget": "embedded_enlarged (20t/1024)"}
    assert_png(plot_budget_transfer([RESULT, enlarged], tmp_path / "f5.png"), 8, 3.8)
    rows = [
        {
            "check": name,
            "seeds": [0, 1, 2],
            "dev_tgc": Estimate(v, v - 0.1, v + 0.05, 3),
            "hard_tgc": Estimate(v, v, v, 3),
        }
        for name, v in (("recipe", 0.8), ("no_kl", 0.7), ("n8", 0.6))
    ]
    assert_png(plot_check_bars(rows, tmp_path / "f6.png"), 11, 0.45 * 3 + 1.6)
    curves = {
        "success": [0.1 * s for s in range(10)],
        "entropy": [1.0] * 10,
        "mixed": [0.5] * 10,
        "dev_tgc": [(5, 0.4), (10, 0.6)],
    }
    results = {"recipe": {0: {"curves": curves}, 1: {"curves": curves}}, "n8": {0: {"curves": curves}}, "none": {}}
    assert_png(plot_check_curves(results, tmp_path / "f34.png"), 18, 4.2)


def test_training_plots_from_tensorboard(tmp_path):
    writer = SummaryWriter(tmp_path / "tb")
    for tag, points in SERIES.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    paths = training_plots(tmp_path / "tb", tmp_path, group_size=16)
    assert [p.name for p in paths] == [
        "learning_curve.png",
        "fig2_coverage.png",
        "fig3_group_composition.png",
        "fig4_entropy_score.png",
    ]
    assert_png(paths[0], 15, 3.6)
    for path in paths[1:]:
        assert_png(path, 10, 3.8)


@pytest.mark.parametrize("missing", ["eval/training_budget/tgc_all", "coverage/psig_tier1"])
def test_figures_tolerate_missing_series(tmp_path, missing):
    series = {k: v for k, v in SERIES.items() if k != missing}
    assert_png(plot_drift({"run": series}, tmp_path / "f4.png"), 10, 3.8)
    assert_png(plot_group_composition(series, tmp_path / "f3.png"), 10, 3.8)
