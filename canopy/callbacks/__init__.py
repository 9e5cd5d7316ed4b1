"""Lightning callbacks of the recipe, each swappable by config (`conf/callbacks/`): fault quarantine stats,
coverage logging (Eq. 4), entropy monitoring (Fig. 4), budget-transfer evaluation (Fig. 5), the on-policy audit and
the rollout viewer."""

from hydra.utils import instantiate
from omegaconf import DictConfig

from canopy.callbacks.budget_transfer import BudgetTransferEval
from canopy.callbacks.coverage_logger import CoverageLogger
from canopy.callbacks.entropy_monitor import EntropyMonitor
from canopy.callbacks.on_policy_audit import OnPolicyAudit
from canopy.callbacks.quarantine_stats import QuarantineStats
from canopy.callbacks.rollout_viewer import RolloutViewer

__all__ = [
    "BudgetTransferEval",
    "CoverageLogger",
    "EntropyMonitor",
    "OnPolicyAudit",
    "QuarantineStats",
    "RolloutViewer",
    "build_callbacks",
]


def build_callbacks(cfg: DictConfig) -> list:
    """Instantiate every `callbacks.<name>` entry that is not null (`callbacks.<name>=null` switches one off)."""
    return [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node is not None]
