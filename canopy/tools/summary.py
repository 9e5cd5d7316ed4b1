"""End-of-run report: base vs final success on the training tasks, by tier."""

import json
from dataclasses import dataclass
from pathlib import Path

import lightning as L

from canopy.errors import require
from canopy.eval.metrics import summarize
from canopy.eval.runner import sample_runs
from canopy.modules.parallel import alone_on_rank0


def success_by_tier(datamodule, samples_per_task: int, description: str) -> dict[str, float]:
    """Mean sparse success (mean@k TGC) of the engine's current weights over every pool task, by tier."""
    dm = datamodule
    runs = sample_runs(
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
    ).runs
    return {tier: row["tgc_mean"] for tier, row in summarize(dm.tasks, runs).items()}


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
    """`success_by_tier` of the base policy, measured by rank 0 when training starts, before the first rollout (the
    other ranks wait on the store, outside any collective); `result` is None on the other ranks."""

    def __init__(self, samples_per_task: int):
        self.samples_per_task, self.result = samples_per_task, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.result = alone_on_rank0(
            trainer,
            "canopy/base_success",
            "base-policy evaluation",
            lambda: success_by_tier(trainer.datamodule, self.samples_per_task, "evaluating base policy"),
        )


def format_comparison(base: dict[str, float], final: dict[str, float]) -> str:
    rows = ["| tasks | base | final | change |", "|---|---|---|---|"]
    rows += [f"| {key} | {base[key]:.3f} | {final[key]:.3f} | {final[key] - base[key]:+.3f} |" for key in base]
    return "\n".join(rows)


def write_summary(run_dir: Path, base: dict[str, float], final: dict[str, float]) -> str:
    (run_dir / "summary.json").write_text(json.dumps({"base": base, "final": final}, indent=2))
    table = format_comparison(base, final)
    (run_dir / "summary.md").write_text(f"Success on the training tasks (sparse reward)\n\n{table}\n")
    return table
