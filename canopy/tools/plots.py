"""The paper's figures as PNGs (matplotlib, Agg) from TensorBoard scalars and evaluation JSON:
coverage vs n and p (Fig. 2), group composition by tier (Fig. 3), entropy and dev / success score (Fig. 4),
per-tier budget transfer (Fig. 5) and ablation bars (Fig. 6), plus the run's learning curve."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from canopy.coverage import signal_coverage  # noqa: E402
from canopy.tools.tb_scalars import read_scalars  # noqa: E402

Series = dict[str, list[tuple[int, float]]]
DPI = 100


def _save(fig, out_png: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(out_png, dpi=DPI)
    plt.close(fig)
    return Path(out_png)


SMOOTH = 10  # training curves are drawn as trailing means over this many steps


def _line(ax, series: Series, key: str, smooth: int = 1, **style) -> None:
    """Plot `series[key]`; with `smooth` > 1, each point is the mean of the last `smooth` values."""
    if key in series:
        steps, values = zip(*series[key])
        values = [
            sum(values[max(0, i - smooth + 1) : i + 1]) / (i + 1 - max(0, i - smooth + 1)) for i in range(len(values))
        ]
        ax.plot(steps, values, **{"linewidth": 1.2, "label": key, **style})


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


def plot_ablations(rows: list[dict], out_png: str | Path, metric: str = "score") -> Path:
    """Fig. 6: one bar per variant (the recipe first), its delta to the recipe written on the bar."""
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    labels = [r["variant"] for r in rows][::-1]
    values = [100 * r[metric] for r in rows][::-1]
    bars = ax.barh(labels, values, color=["C0" if label == rows[0]["variant"] else "C1" for label in labels])
    base = 100 * rows[0][metric]
    ax.bar_label(bars, labels=[f"{v:.1f} ({v - base:+.1f})" for v in values], fontsize=7, padding=2)
    ax.set(xlabel=f"{metric} (%)", xlim=(0, 115), title="component ablations")
    ax.grid(alpha=0.3, axis="x")
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
