"""Format monitor: a drifting policy first loses the environment's action format (no code block, no command, several
bash blocks), long before its reward says why. Watches `health/invalid_action_frac`, the step's share of invalid
actions (`StepStats`), averaged over the last `window` steps: warns above `warn_above` and, when `stop_above` is set,
stops the run above it with one line naming the step, the share and the viewer address of an invalid episode."""

import warnings
from collections import deque
from pathlib import Path

import lightning as L

from canopy.callbacks.rollout_viewer import RolloutViewer
from canopy.errors import ConfigError, RunStopped, is_int
from canopy.reports.viewer import episode_address


class FormatDriftError(RunStopped, RuntimeError):
    """The policy's invalid-action share crossed `callbacks.format_monitor.stop_above`: the run stops (train.py)."""

    label = "format drift"


class FormatMonitor(L.Callback):
    def __init__(self, warn_above: float = 0.25, window: int = 10, stop_above: float | None = None):
        share = lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1  # noqa: E731
        if not share(warn_above):
            raise ConfigError(f"callbacks.format_monitor.warn_above={warn_above} must be a share in [0, 1), e.g. 0.25")
        if stop_above is not None and not share(stop_above):
            raise ConfigError(
                f"callbacks.format_monitor.stop_above={stop_above} must be a share in [0, 1), e.g. 0.5, or null (never "
                "stop)"
            )
        if not (is_int(window) and window >= 1):
            raise ConfigError(f"callbacks.format_monitor.window={window} must be a number of steps >= 1, e.g. 10")
        self.warn_above, self.window, self.stop_above = warn_above, window, stop_above
        self.shares: deque = deque(maxlen=window)
        self.example: tuple[int, str, int] | None = None  # (step, task id, sample) of the latest invalid episode
        self.quiet_until = -1  # one warning per window, not one per step

    def check(self, step: int, share: float | None, example: tuple[str, int] | None) -> tuple[str, float] | None:
        """Record rollout step `step`'s invalid-action share (None: no action was answered) and an episode with an
        invalid action; return ("warn" or "stop", the window's mean share) once a full window crosses a threshold."""
        if example is not None:
            self.example = (step, *example)
        if share is None:
            return None
        self.shares.append(share)
        mean = sum(self.shares) / len(self.shares)
        if len(self.shares) < self.window:
            return None
        if self.stop_above is not None and mean > self.stop_above:
            return "stop", mean
        if mean > self.warn_above and step > self.quiet_until:
            self.quiet_until = step + self.window
            return "warn", mean
        return None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = pl_module.weight_version - 1  # the rollout step of this batch: its samples' weight version
        stats = batch.stats
        verdict = self.check(step, stats.metrics.get("health/invalid_action_frac"), stats.invalid_example)
        if verdict is None:
            return
        kind, mean = verdict
        share = f"step {step}: {mean:.1%} of the policy's actions were invalid over the last {self.window} steps"
        if kind == "stop":
            raise FormatDriftError(
                f"{share}, above callbacks.format_monitor.stop_above={self.stop_above} (the KL anchor, "
                f"algorithm.kl_coef, and a smaller optim.lr keep it on format); an invalid episode: "
                f"{self._where(trainer)}"
            )
        warnings.warn(
            f"{share}, above warn_above {self.warn_above}: the policy is losing the action format; an invalid "
            f"episode: {self._where(trainer)}",
            RuntimeWarning,
            stacklevel=1,
        )

    def _where(self, trainer) -> str:
        """The viewer address of the latest invalid episode, where the run logs episodes and builds the viewer (on a
        stop, train.py builds it); else the episode by step, task and sample."""
        step, task, sample = self.example
        logged = trainer.datamodule.trajectory_log is not None
        if logged and any(isinstance(c, RolloutViewer) for c in trainer.callbacks):
            return episode_address(Path(trainer.default_root_dir), "train", step, task, sample)
        return f"step {step}, task {task}, sample {sample} (no rollout viewer in this run)"
