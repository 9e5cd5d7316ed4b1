"""Coverage logging (Section 3.2, Fig. 3): the observed informative (mixed) fraction of each tier's groups
against P_sig = 1 - p^n - (1-p)^n predicted by Eq. 4 from the tier's current success rate p."""

import lightning as L

from canopy.coverage import signal_coverage
from canopy.step import StepStats


def predicted_coverage(stats: StepStats) -> dict[str, float]:
    """`coverage/psig_tier<K>` per tier: P_sig at the tier's success rate p, averaged over its groups' scored
    rollouts n (one n for all with a fixed group size; each task's own with `group_size=auto`), and their
    group-weighted mean `coverage/psig`."""
    out, weighted, groups = {}, 0.0, 0
    for tier, sizes in stats.scored_sizes_by_tier.items():
        if tier not in stats.success_by_tier:
            continue
        p = stats.success_by_tier[tier]
        out[f"coverage/psig_tier{tier}"] = sum(signal_coverage(p, max(1, n)) for n in sizes) / len(sizes)
        weighted += out[f"coverage/psig_tier{tier}"] * len(sizes)
        groups += len(sizes)
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
