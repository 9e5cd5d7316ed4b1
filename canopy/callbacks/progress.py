"""The run's console: in a terminal, one step bar (`step N/M`, ETA, the step's success and KL) with each rollout
step's episode bar updating in place beneath it (`canopy.rollout.agent_loop`); piped to a file, no bars but one
line every `every_n_steps` steps and at the last."""

import time

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from tqdm.auto import tqdm

from canopy.errors import is_int, require
from canopy.rollout.agent_loop import interactive


class StepProgress(ProgressBar):
    """Lightning's progress bar for rollout steps (Lightning counts optimizer steps; an ablation may take several
    per rollout batch)."""

    def __init__(self, every_n_steps: int = 10):
        super().__init__()
        require(
            is_int(every_n_steps) and every_n_steps >= 1,
            f"callbacks.progress.every_n_steps={every_n_steps} must be a positive integer (a line every N steps)",
        )
        self.every_n_steps = every_n_steps
        self.bar: tqdm | None = None
        self.enabled = True
        self.started = 0.0

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def steps(self, trainer: "L.Trainer") -> tuple[int, int]:
        """(rollout steps done, rollout steps of the run)."""
        updates = trainer.lightning_module.updates_per_batch
        return trainer.global_step // updates, -(-trainer.max_steps // updates)

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if not (self.enabled and trainer.is_global_zero):
            return
        self.started = time.monotonic()
        done, total = self.steps(trainer)
        if interactive():
            self.bar = tqdm(total=total, initial=done, desc="step", unit="step", dynamic_ncols=True, position=0)

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx):
        if not (self.enabled and trainer.is_global_zero):
            return
        done, total = self.steps(trainer)
        metrics = trainer.callback_metrics
        shown = {name: float(metrics[key]) for name, key in (("success", "reward/success"), ("kl", "actor/kl"))
                 if key in metrics}  # fmt: skip
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=True)
            if done >= total:  # before Lightning says why fit stopped
                self.on_train_end(trainer, pl_module)
            return
        if done % self.every_n_steps and done != total:
            return
        elapsed = time.monotonic() - self.started
        eta = elapsed / max(1, done) * (total - done)
        values = " ".join(f"{k} {v:.3g}" for k, v in shown.items())
        print(f"step {done}/{total}  elapsed {clock(elapsed)}  eta {clock(eta)}  {values}", flush=True)

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def clock(seconds: float) -> str:
    """`1:02:03` or `2:03`."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
