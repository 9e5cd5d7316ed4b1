"""The rollout viewer as the run goes: `<run>/viewer.html` (canopy/tools/viewer.py) rebuilt every `every_n_steps`
steps on a background thread of the generating rank (a build still running when the next is due is skipped, so it
never holds a step back), and once more when the run ends (`final`, called by train.py after its last figures)."""

import threading
from pathlib import Path

import lightning as L

from canopy.tools.viewer import build_viewer


class RolloutViewer(L.Callback):
    def __init__(self, every_n_steps: int = 20, steps: int = 5, max_chars: int = 4000):
        self.every_n_steps, self.steps, self.max_chars = every_n_steps, steps, max_chars
        self.thread: threading.Thread | None = None
        self.run_dir: Path | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.run_dir = Path(trainer.default_root_dir)
        step = trainer.global_step
        if not trainer.is_global_zero or not self.every_n_steps or step % self.every_n_steps:
            return
        if self.thread is not None and self.thread.is_alive():
            return
        self.thread = threading.Thread(target=self.build, name="rollout-viewer", daemon=True)
        self.thread.start()

    def build(self) -> Path:
        return build_viewer(self.run_dir, self.steps, self.max_chars)

    def final(self, run_dir: str | Path) -> Path:
        """The last build, after every log and figure of the run is written."""
        if self.thread is not None:
            self.thread.join()
        self.run_dir = Path(run_dir)
        return self.build()
