"""Entropy monitor (Section 3.3, Fig. 4): the policy's action-token entropy collapsing is the face of drift
(0.038 without the KL anchor against 0.217 with it, Table A2). Warns on a collapse below `min_entropy`
or a fall of more than `max_relative_drop` within `window` steps."""

import warnings
from collections import deque

import lightning as L

from canopy.callbacks.common import scalar


class EntropyMonitor(L.Callback):
    def __init__(self, min_entropy: float = 0.03, window: int = 20, max_relative_drop: float = 0.75):
        self.min_entropy, self.window, self.max_relative_drop = min_entropy, window, max_relative_drop
        self.history: deque = deque(maxlen=window + 1)
        self.alerts: list[str] = []
        self.quiet_until = -1  # one warning per window, not one per step

    def check(self, step: int, entropy: float) -> str | None:
        """Record this step's entropy; return the alert it raises, if any."""
        self.history.append(entropy)
        alert = None
        if entropy < self.min_entropy:
            alert = f"entropy {entropy:.4f} < min_entropy {self.min_entropy}"
        elif len(self.history) > self.window and self.history[0] > 0:
            drop = 1.0 - entropy / self.history[0]
            if drop > self.max_relative_drop:
                alert = f"entropy fell {drop:.0%} in {self.window} steps ({self.history[0]:.4f} -> {entropy:.4f})"
        if alert is None or step <= self.quiet_until:
            return None
        self.quiet_until = step + self.window
        self.alerts.append(alert)
        return alert

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        alert = self.check(pl_module.weight_version, scalar(trainer.callback_metrics["actor/entropy"]))
        if alert:
            warnings.warn(
                f"step {pl_module.weight_version}: policy entropy collapsing: {alert}; the KL anchor "
                "(algorithm.kl_coef) and strict on-policy updates keep it alive (Fig. 4)",
                RuntimeWarning,
                stacklevel=1,
            )
