"""End-of-run report: base vs final success on the training tasks (by tier) and a learning-curve PNG."""

import json
from collections import defaultdict
from pathlib import Path

from canopy.rollout.agent_loop import run_episodes
from canopy.tb import read_scalars


def success_by_tier(datamodule, samples_per_task: int, description: str) -> dict[str, float]:
    """Mean sparse success of the engine's current weights over every pool task, `samples_per_task` each."""
    jobs = [(task, i) for task in datamodule.tasks for i in range(samples_per_task)]
    trajectories, _ = run_episodes(
        datamodule.engine, datamodule.env, datamodule.tokenizer, jobs, datamodule.budget, datamodule.sampling,
        seed=-len(jobs), description=description,
    )
    scored = [t for t in trajectories if t.quarantine is None]
    by_tier: dict[int, list[float]] = defaultdict(list)
    for t in scored:
        by_tier[t.task.tier].append(float(t.verdict is not None and t.verdict.success))
    result = {"all": sum(sum(v) for v in by_tier.values()) / max(1, len(scored))}
    result.update({f"tier{tier}": sum(v) / len(v) for tier, v in sorted(by_tier.items())})
    return result


def format_comparison(base: dict[str, float], final: dict[str, float]) -> str:
    rows = ["| tasks | base | final | change |", "|---|---|---|---|"]
    rows += [f"| {key} | {base[key]:.3f} | {final[key]:.3f} | {final[key] - base[key]:+.3f} |" for key in base]
    return "\n".join(rows)


def plot_learning_curve(log_dir: str | Path, out_png: str | Path) -> Path:
    """Success (overall and by tier), group composition, entropy and KL against the training step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_scalars(log_dir)
    panels = [
        ("success", [k for k in ("reward/success", "success/tier1", "success/tier2", "success/tier3") if k in series]),
        ("group composition", [k for k in ("coverage/mixed", "coverage/all_fail", "coverage/all_success") if k in series]),
        ("drift", [k for k in ("actor/entropy", "actor/kl") if k in series]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            steps, values = zip(*series[key])
            ax.plot(steps, values, label=key, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


def write_summary(run_dir: Path, base: dict[str, float], final: dict[str, float]) -> str:
    (run_dir / "summary.json").write_text(json.dumps({"base": base, "final": final}, indent=2))
    table = format_comparison(base, final)
    (run_dir / "summary.md").write_text(f"Success on the training tasks (sparse reward)\n\n{table}\n")
    return table
