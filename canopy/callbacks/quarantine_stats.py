"""Fault quarantine statistics (Appendix G): per-step counts by reason come from the step's `StepStats`; this keeps
running totals and warns when a step's quarantine rate says the serving layer, not the agent, is failing."""

import warnings
from collections import Counter

import lightning as L


class QuarantineStats(L.Callback):
    """Logs `quarantine/rate` and running totals `quarantine_total/<reason>` (and `/all`); warns above `warn_rate`."""

    def __init__(self, warn_rate: float = 0.05):
        self.warn_rate = warn_rate
        self.totals: Counter = Counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = batch.stats
        quarantined = sum(stats.quarantined.values())
        self.totals.update(stats.quarantined)
        self.totals["all"] += quarantined
        rate = quarantined / max(1, stats.episodes)
        logged = {"quarantine/rate": rate, **{f"quarantine_total/{r}": float(c) for r, c in self.totals.items()}}
        pl_module.log_dict(logged, on_step=True, on_epoch=False, batch_size=1)
        if rate > self.warn_rate:
            reasons = ", ".join(f"{reason}={count}" for reason, count in stats.quarantined.items())
            warnings.warn(
                f"step {pl_module.weight_version}: {rate:.1%} of episodes quarantined ({reasons}) > "
                f"warn_rate {self.warn_rate:.1%}: check the environment workers",
                RuntimeWarning,
                stacklevel=1,
            )

    def state_dict(self) -> dict:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.totals = Counter(state_dict["totals"])
