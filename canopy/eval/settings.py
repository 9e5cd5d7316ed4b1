"""`eval.*`: the held-out evaluation during training (Sec. 4.3), at the training budget and the enlarged one."""

from dataclasses import dataclass

from canopy.errors import require
from canopy.rollout.budget import BudgetSettings
from canopy.rollout.engine import SamplingParams


@dataclass
class TestTimeBudget:
    """A budget group composed elsewhere than at the root (`budget@eval.enlarged=<name>`): its two nodes."""

    budget: BudgetSettings
    sampling: SamplingParams


@dataclass
class EvalSettings:
    """`eval.*`, the held-out evaluation during training: the schema (conf/train.yaml holds the defaults)."""

    split: str
    k: int
    every_n_steps: int
    enlarged: TestTimeBudget

    def validate(self) -> None:
        require(self.k >= 1, f"eval.k={self.k} must be a positive integer (runs per task, mean@k)")
        require(
            self.every_n_steps >= 0,
            f"eval.every_n_steps={self.every_n_steps} must be 0 (only at the end) or a positive integer",
        )
        self.enlarged.budget.validate("eval.enlarged.budget")
        self.enlarged.sampling.validate("eval.enlarged.sampling")
