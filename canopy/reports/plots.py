"""The paper's figures as PNGs (matplotlib, Agg) from TensorBoard scalars and evaluation JSON:
coverage vs n and p (Fig. 2), group composition by tier (Fig. 3), entropy and dev / success score (Fig. 4),
per-tier budget transfer (Fig. 5), and over seeds the paper checks' bars (Fig. 6) and curves (Figs. 3, 4), plus
the run's learning curve."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from canopy.coverage import signal_coverage  # noqa: E402
from canopy.reports.tb_scalars import read_scalars  # noqa: E402

Series = dict[str, list[tuple[int, float]]]
DPI = 100


def _save(fig, out_png: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(out_png, dpi=DPI)
    plt.close(fig)
    return Path(out_png)


SMOOTH = 10  # training curves are drawn as trailing means over this many steps


def _trailing_mean(values, smooth: int) -> list[float]:
    """Each value replaced by the mean of the last `smooth` values up to it (fewer at the start)."""
    return [sum(values[max(0, i - smooth + 1) : i + 1]) / (i + 1 - max(0, i - smooth + 1)) for i in range(len(values))]


def _line(ax, series: Series, key: str, smooth: int = 1, **style) -> None:
    """Plot `series[key]`; with `smooth` > 1, each point is the mean of the last `smooth` values."""
    if key in series:
        steps, values = zip(*series[key])
        ax.plot(steps, _trailing_mean(values, smooth), **{"linewidth": 1.2, "label": key, **style})


def _tiers(series: Series) -> list[str]:
    return sorted(k.removeprefix("success/") for k in series if k.startswith("success/tier"))


def plot_learning_curve(series: Series, out_png: str | Path) -> Path:
    """Success (overall and by tier), group composition, entropy and KL against the training step."""
    panels = [
        ("success", ["reward/success"] + [f"success/{t}" for t in _tiers(series)]),
        ("group composition", ["coverage/mixed", "coverage/all_fail", "coverage/all_success"]),
        ("drift", ["actor/entropy", "actor/kl"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.6))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            _line(ax, series, key, smooth=SMOOTH)
        ax.set(title=f"{title} ({SMOOTH}-step mean)", xlabel="step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _save(fig, out_png)


def plot_coverage(out_png: str | Path, group_size: int = 32, tier_rates: dict[str, float] | None = None) -> Path:
    """Fig. 2: (a) P_sig vs group size n for a few success rates p (and the tiers' measured p);
    (b) P_sig vs p at fixed n: signal collapses at both extremes (Eq. 4)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    ns = list(range(1, 129))
    rates = {f"p={p}": p for p in (0.05, 0.2, 0.5)} | {f"{t} p={p:.2f}": p for t, p in (tier_rates or {}).items()}
    for label, p in rates.items():
        a.plot(
            ns, [signal_coverage(p, n) for n in ns], label=label, linestyle="--" if label.startswith("tier") else "-"
        )
    a.axvline(group_size, color="gray", linewidth=0.8, label=f"n={group_size}")
    a.set(xscale="log", xlabel="group size n", ylabel="P_sig", title="(a) coverage vs n")
    ps = [i / 200 for i in range(201)]
    for n in sorted({8, 16, 32, 64, group_size}):
        b.plot(ps, [signal_coverage(p, n) for p in ps], label=f"n={n}")
    b.set(xlabel="per-rollout success rate p", ylabel="P_sig", title="(b) coverage vs p")
    for ax in (a, b):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _save(fig, out_png)


def plot_group_composition(series: Series, out_png: str | Path) -> Path:
    """Fig. 3: (A) all-fail / mixed / all-success group fractions over training; (B) the informative (mixed)
    fraction per tier, observed (solid) against Eq. 4's prediction from the tier's success rate (dashed)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind in ("all_fail", "mixed", "all_success"):
        _line(a, series, f"coverage/{kind}", smooth=SMOOTH, label=kind)
    a.set(title=f"(A) group composition ({SMOOTH}-step mean)", xlabel="step", ylabel="fraction of groups")
    for i, tier in enumerate(_tiers(series)):
        color = f"C{i}"
        _line(b, series, f"coverage/mixed_{tier}", smooth=SMOOTH, label=f"{tier} observed", color=color)
        _line(
            b,
            series,
            f"coverage/psig_{tier}",
            smooth=SMOOTH,
            label=f"{tier} P_sig (Eq. 4)",
            color=color,
            linestyle="--",
        )
    b.set(title=f"(B) informative groups by tier ({SMOOTH}-step mean)", xlabel="step", ylabel="mixed fraction")
    for ax in (a, b):
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _save(fig, out_png)


def plot_drift(runs: dict[str, Series], out_png: str | Path) -> Path:
    """Fig. 4: policy entropy and score vs step, one line per run (e.g. the recipe against no_kl). The score is
    the dev TGC of the budget-transfer callback at the training budget when logged, else train success."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (label, series) in enumerate(runs.items()):
        color = f"C{i}"
        _line(a, series, "actor/entropy", label=label, color=color)
        _line(b, series, "reward/success", label=f"{label} train success", color=color, alpha=0.5)
        _line(
            b, series, "eval/training_budget/tgc_all", label=f"{label} dev TGC", color=color, marker="o", linestyle="--"
        )
    a.set(title="policy entropy (action tokens)", xlabel="step", ylabel="entropy")
    b.set(title="score", xlabel="step", ylabel="success / TGC", ylim=(-0.02, 1.02))
    for ax in (a, b):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _save(fig, out_png)


def plot_budget_transfer(results: list[dict], out_png: str | Path) -> Path:
    """Fig. 5: mean@k TGC per difficulty tier, one bar per evaluation (budget)."""
    tiers = [t for t in results[0]["metrics"] if t != "all"] + ["all"]
    width = 0.8 / len(results)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, r in enumerate(results):
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(tiers))]
        values = [100 * r["metrics"].get(t, {}).get("tgc_mean", 0.0) for t in tiers]
        bars = ax.bar(xs, values, width, label=f"{r['policy']}, {r['budget']}")
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(tiers)), tiers)
    ax.set(ylabel=f"TGC mean@{results[0]['k']} (%)", ylim=(0, 110), title=f"budget transfer ({results[0]['split']})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out_png)


def plot_check_bars(rows: list[dict], out_png: str | Path) -> Path:
    """Fig. 6 over seeds (`bench/paper_checks.py`): each check's mean dev TGC and hardest-tier TGC, with its 95%
    bootstrap interval as an error bar; the recipe first, its mean as a dotted line."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.6), sharey=True)
    labels = [f"{r['check']} ({len(r['seeds'])})" for r in rows][::-1]
    for ax, (key, title) in zip(axes, (("dev_tgc", "dev TGC"), ("hard_tgc", "hardest-tier dev TGC"))):
        estimates = [r[key] for r in rows][::-1]
        means = [100 * e.mean for e in estimates]
        errors = [[100 * (e.mean - e.low) for e in estimates], [100 * (e.high - e.mean) for e in estimates]]
        colors = ["C0" if r["check"] == "recipe" else "C1" for r in rows][::-1]
        ax.barh(labels, means, xerr=errors, color=colors, capsize=3, error_kw={"linewidth": 1})
        if rows[0]["check"] == "recipe":
            ax.axvline(100 * rows[0][key].mean, color="C0", linestyle=":", linewidth=1)
        ax.set(xlabel=f"{title} (%)", xlim=(0, 105))
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_title("check (seeds)", loc="left", fontsize=9)
    fig.suptitle("mean over seeds, 95% bootstrap interval", fontsize=10)
    return _save(fig, out_png)


def plot_check_curves(results: dict[str, dict[int, dict]], out_png: str | Path) -> Path:
    """Figs. 3 and 4 over seeds: informative (mixed) groups, policy entropy, train success and dev TGC against
    the step, per check the mean over seeds (line) and their range (band)."""
    panels = (
        ("mixed", "(Fig. 3) mixed groups", SMOOTH),
        ("entropy", "(Fig. 4) policy entropy", SMOOTH),
        ("success", "train success", SMOOTH),
        ("dev_tgc", "(Fig. 4) dev TGC", 1),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 4.2))
    for i, (check, by_seed) in enumerate(item for item in results.items() if item[1]):
        style = {"color": f"C{i % 10}", "linestyle": "-" if i < 10 else "--"}
        for ax, (key, title, smooth) in zip(axes, panels):
            curves = [r["curves"][key] for r in by_seed.values()]
            if key == "dev_tgc":
                steps = [step for step, _ in curves[0]]
                curves = [[value for _, value in curve] for curve in curves]
            else:
                steps = list(range(min(len(c) for c in curves)))
                curves = [_trailing_mean(c, smooth) for c in curves]
            width = min(len(c) for c in curves)
            steps, curves = steps[:width], [c[:width] for c in curves]
            mean = [sum(values) / len(values) for values in zip(*curves)]
            ax.plot(steps, mean, label=check, linewidth=1.2, marker="o" if key == "dev_tgc" else None, **style)
            ax.fill_between(
                steps, [min(v) for v in zip(*curves)], [max(v) for v in zip(*curves)], alpha=0.12, color=style["color"]
            )
            ax.set(title=title + ("" if smooth == 1 else f" ({smooth}-step mean)"), xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="lower right")
    return _save(fig, out_png)


def training_plots(log_dir: str | Path, run_dir: str | Path, group_size: int) -> list[Path]:
    """The training-time figures of a run: learning curve and Figs. 2-4 (coverage marked at the tiers'
    step-0 success rates)."""
    run_dir = Path(run_dir)
    series = read_scalars(log_dir)
    rates = {t: series[f"success/{t}"][0][1] for t in _tiers(series)}
    return [
        plot_learning_curve(series, run_dir / "learning_curve.png"),
        plot_coverage(run_dir / "fig2_coverage.png", group_size, rates),
        plot_group_composition(series, run_dir / "fig3_group_composition.png"),
        plot_drift({"run": series}, run_dir / "fig4_entropy_score.png"),
    ]
