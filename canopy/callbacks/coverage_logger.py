"""Coverage logging (Section 3.2, Fig. 3): the observed informative (mixed) fraction of each tier's groups
against P_sig = 1 - p^n - (1-p)^n predicted by Eq. 4 from the tier's current success rate p."""

import lightning as L

from canopy.callbacks.common import scalar
from canopy.coverage import signal_coverage


def predicted_coverage(metrics: dict) -> dict[str, float]:
    """`coverage/psig_tier<K>` per tier and their group-weighted mean `coverage/psig`, from a step's rollout
    metrics (`success/tier<K>`, `coverage/groups_tier<K>`, `coverage/group_size`)."""
    n = max(1, round(scalar(metrics["coverage/group_size"])))
    out, weighted, groups = {}, 0.0, 0.0
    for key, value in metrics.items():
        if key.startswith("coverage/groups_tier"):
            tier = key.removeprefix("coverage/groups_")
            if f"success/{tier}" not in metrics:
                continue
            out[f"coverage/psig_{tier}"] = signal_coverage(scalar(metrics[f"success/{tier}"]), n)
            weighted += out[f"coverage/psig_{tier}"] * scalar(value)
            groups += scalar(value)
    if groups:
        out["coverage/psig"] = weighted / groups
    return out


class CoverageLogger(L.Callback):
    """Logs the Eq. 4 prediction next to the observed group composition (`coverage/{mixed,all_fail,all_success}`
    and `_tier<K>`, which the data module reports every step)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        logged = predicted_coverage(batch.metrics)
        if logged:
            pl_module.log_dict(logged, on_step=True, on_epoch=False, batch_size=1)
