"""Coverage logging (Section 3.2, Fig. 3): the observed informative (mixed) fraction of each tier's groups
against P_sig = 1 - p^n - (1-p)^n predicted by Eq. 4 from the tier's current success rate p."""

import lightning as L

from canopy.coverage import signal_coverage
from canopy.datamodules.rollout import StepStats


def predicted_coverage(stats: StepStats) -> dict[str, float]:
    """`coverage/psig_tier<K>` per tier, from the tier's success rate p and the scored rollouts per group n, and
    their group-weighted mean `coverage/psig`."""
    n = max(1, round(stats.scored_per_group))
    out, weighted, groups = {}, 0.0, 0
    for tier, count in stats.groups_by_tier.items():
        if tier not in stats.success_by_tier:
            continue
        out[f"coverage/psig_tier{tier}"] = signal_coverage(stats.success_by_tier[tier], n)
        weighted += out[f"coverage/psig_tier{tier}"] * count
        groups += count
    if groups:
        out["coverage/psig"] = weighted / groups
    return out


class CoverageLogger(L.Callback):
    """Logs the Eq. 4 prediction next to the observed group composition (`coverage/{mixed,all_fail,all_success}`
    and `_tier<K>`, which the data module reports every step)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        logged = predicted_coverage(batch.stats)
        if logged:
            pl_module.log_dict(logged, on_step=True, on_epoch=False, batch_size=1)
