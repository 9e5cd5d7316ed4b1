"""Environments with a broken setup, for the systematic-fault tests (importable by pool workers)."""

from pathlib import Path

from canopy.envs.base import EnvironmentFault, Task
from canopy.envs.embedded import EmbeddedEnvironment


class GatedEnvironment(EmbeddedEnvironment):
    """The vault world, whose setup breaks once the `gate` file is gone (as a deleted data root would)."""

    def __init__(self, gate: str):
        if not Path(gate).exists():
            raise RuntimeError(f"setup broke: {gate} is gone")
        super().__init__()


class FailingEnvironment(EmbeddedEnvironment):
    """The vault world whose episodes fail to start, as a server with a broken setup would: every task whose
    id is in `failing` (all when None) raises a serving fault with a multi-line detail, like a server's log."""

    def __init__(self, failing: set[str] | None = None):
        super().__init__()
        self.failing = failing

    def start(self, task: Task, seed: int):
        if self.failing is None or task.task_id in self.failing:
            raise EnvironmentFault(
                "server_request_failed",
                f"/initialize answered 500 for {task.task_id}:\nTraceback ...\n"
                "PermissionError: [Errno 13] Permission denied: '/home/u/.ipython'",
            )
        return super().start(task, seed)
