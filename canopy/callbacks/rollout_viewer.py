"""The rollout viewer as the run goes: `<run>/viewer.html` (canopy/reports/viewer.py) rebuilt every `every_n_steps`
steps by a process of its own at idle priority, started by the generating rank (a build still running when the next
is due is skipped, so it never holds a step back; reading the logs and encoding the page on a thread held the GIL the
training loop needs), and once more when the run ends (`final`, called by train.py after its last figures)."""

import subprocess
import sys
from pathlib import Path

import lightning as L

from canopy.reports.viewer import build_viewer
from canopy.trajectories import lower_to_idle_priority


class RolloutViewer(L.Callback):
    def __init__(self, every_n_steps: int = 20, steps: int = 5, max_chars: int = 4000):
        self.every_n_steps, self.steps, self.max_chars = every_n_steps, steps, max_chars
        self.process: subprocess.Popen | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or not self.every_n_steps or step % self.every_n_steps:
            return
        if self.process is not None and self.process.poll() is None:
            return
        arguments = [str(trainer.default_root_dir), str(self.steps), str(self.max_chars)]
        self.process = subprocess.Popen([sys.executable, "-m", "canopy.tools.viewer", *arguments])
        lower_to_idle_priority(self.process.pid)  # from its first import on

    def final(self, run_dir: str | Path) -> Path:
        """The last build, after every log and figure of the run is written."""
        if self.process is not None:
            self.process.wait()
        return build_viewer(Path(run_dir), self.steps, self.max_chars)
