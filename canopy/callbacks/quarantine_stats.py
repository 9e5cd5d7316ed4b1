"""Fault quarantine statistics (Appendix G): per-step counts by reason come from the rollout metrics; this keeps
running totals and warns when a step's quarantine rate says the serving layer, not the agent, is failing."""

import warnings
from collections import Counter

import lightning as L

from canopy.callbacks.common import scalar


class QuarantineStats(L.Callback):
    """Logs `quarantine/rate` and running totals `quarantine_total/<reason>` (and `/all`); warns above `warn_rate`."""

    def __init__(self, warn_rate: float = 0.05):
        self.warn_rate = warn_rate
        self.totals: Counter = Counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = batch.metrics
        episodes, quarantined = scalar(m["rollout/episodes"]), scalar(m["rollout/quarantined"])
        for key, value in m.items():
            if key.startswith("quarantine/"):
                self.totals[key.removeprefix("quarantine/")] += int(scalar(value))
        self.totals["all"] += int(quarantined)
        rate = quarantined / max(1.0, episodes)
        logged = {"quarantine/rate": rate, **{f"quarantine_total/{r}": float(c) for r, c in self.totals.items()}}
        pl_module.log_dict(logged, on_step=True, on_epoch=False, batch_size=1)
        if rate > self.warn_rate:
            reasons = ", ".join(
                f"{k.removeprefix('quarantine/')}={int(scalar(v))}" for k, v in m.items() if k.startswith("quarantine/")
            )
            warnings.warn(
                f"step {trainer.global_step}: {rate:.1%} of episodes quarantined ({reasons}) > "
                f"warn_rate {self.warn_rate:.1%}: check the environment workers",
                RuntimeWarning,
                stacklevel=1,
            )

    def state_dict(self) -> dict:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.totals = Counter(state_dict["totals"])
