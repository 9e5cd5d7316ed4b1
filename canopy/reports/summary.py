"""End-of-run report: base vs final success on the training tasks, and their invalid-action share, by tier."""

import json
from dataclasses import dataclass
from pathlib import Path

import lightning as L

from canopy.errors import require
from canopy.eval.metrics import summarize
from canopy.eval.runner import sample_runs
from canopy.modules.parallel import alone_on_rank0
from canopy.rollout.trajectory import invalid_action_fracs


def training_task_report(datamodule, samples_per_task: int, description: str) -> dict[str, dict[str, float]]:
    """The engine's current weights over every pool task: `success`, the mean sparse success (mean@k TGC), and
    `invalid_action_frac`, the share of the actions the environment answered that were invalid for it (format
    health, `invalid_action_fracs`), each by tier and over all."""
    dm = datamodule
    sampled = sample_runs(
        dm.engine,
        dm.env,
        dm.tokenizer,
        dm.tasks,
        samples_per_task,
        dm.budget,
        dm.sampling,
        seed=-len(dm.tasks) * samples_per_task,
        description=description,
        max_quarantine_fraction=dm.max_quarantine_fraction,
    )
    return {
        "success": {tier: row["tgc_mean"] for tier, row in summarize(dm.tasks, sampled.runs).items()},
        "invalid_action_frac": invalid_action_fracs(sampled.actions_by_tier),
    }


@dataclass
class ReportSettings:
    """`report.*`: the schema (conf/train.yaml holds the defaults)."""

    eval_samples_per_task: int  # > 0: evaluate base and final policy on the training tasks at the end of training

    def validate(self) -> None:
        require(
            self.eval_samples_per_task >= 0,
            f"report.eval_samples_per_task={self.eval_samples_per_task} must be 0 (off) or a positive integer",
        )


class BaseSuccess(L.Callback):
    """`training_task_report` of the base policy, measured by rank 0 when training starts, before the first rollout
    (the other ranks wait on the store, outside any collective); `result` is None on the other ranks."""

    def __init__(self, samples_per_task: int):
        self.samples_per_task, self.result = samples_per_task, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.result = alone_on_rank0(
            trainer,
            "canopy/base_success",
            "base-policy evaluation",
            lambda: training_task_report(trainer.datamodule, self.samples_per_task, "evaluating base policy"),
        )


def format_comparison(base: dict[str, float], final: dict[str, float]) -> str:
    """A markdown table of the rows both have."""
    rows = ["| tasks | base | final | change |", "|---|---|---|---|"]
    rows += [f"| {k} | {base[k]:.3f} | {final[k]:.3f} | {final[k] - base[k]:+.3f} |" for k in base if k in final]
    return "\n".join(rows)


def write_summary(run_dir: Path, base: dict[str, dict[str, float]], final: dict[str, dict[str, float]]) -> str:
    """`summary.json` and `summary.md` from the base and final `training_task_report`; returns the tables."""
    health = {"base": base["invalid_action_frac"], "final": final["invalid_action_frac"]}
    summary = {"base": base["success"], "final": final["success"], "invalid_action_frac": health}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    tables = (
        f"{format_comparison(base['success'], final['success'])}\n\nInvalid actions (share of the actions the "
        f"environment answered):\n{format_comparison(health['base'], health['final'])}"
    )
    (run_dir / "summary.md").write_text(f"Success on the training tasks (sparse reward)\n\n{tables}\n")
    return tables
