"""Lightning callbacks of the recipe, each swappable by config (`conf/callbacks/`): fault quarantine stats,
coverage logging (Eq. 4), entropy monitoring (Fig. 4), format health monitoring, budget-transfer evaluation (Fig. 5),
the on-policy audit, the rollout viewer and the console's step progress."""

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from canopy.callbacks.budget_transfer import BudgetTransferEval
from canopy.callbacks.coverage_logger import CoverageLogger
from canopy.callbacks.entropy_monitor import EntropyMonitor
from canopy.callbacks.format_monitor import FormatDriftError, FormatMonitor
from canopy.callbacks.on_policy_audit import OnPolicyAudit
from canopy.callbacks.progress import StepProgress
from canopy.callbacks.quarantine_stats import QuarantineStats
from canopy.callbacks.rollout_viewer import RolloutViewer
from canopy.errors import ConfigError

__all__ = [
    "BudgetTransferEval",
    "CoverageLogger",
    "EntropyMonitor",
    "FormatDriftError",
    "FormatMonitor",
    "OnPolicyAudit",
    "QuarantineStats",
    "RolloutViewer",
    "StepProgress",
    "build_callbacks",
]


def build_callbacks(cfg: DictConfig) -> list:
    """Instantiate every `callbacks.<name>` entry that is not null (`callbacks.<name>=null` switches one off). A
    callback that refuses its settings raises its own `ConfigError` (one line naming the fix), not Hydra's wrapper."""
    callbacks = []
    for node in (cfg.get("callbacks") or {}).values():
        if node is None:
            continue
        try:
            callbacks.append(instantiate(node))
        except InstantiationException as error:
            if isinstance(error.__cause__, ConfigError):
                raise error.__cause__ from None
            raise
    return callbacks
