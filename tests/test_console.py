"""The console of `python train.py`: in a real terminal (tmux) one step bar with each rollout step's bar updating in
place beneath it; piped to a file, a line every N steps and no bars; the resolved config written to the run folder
(printed only on request), no empty log file, and no scratch folder left behind."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import train_args

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_piped_the_run_prints_a_line_every_n_steps_and_leaves_its_config_and_no_scratch(tmp_path, warm_tiny):
    run_dir, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    args = train_args(warm_tiny, run_dir, 3, "callbacks.progress.every_n_steps=2", "env.pool.workers=2")
    run = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(scratch)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["2/3", "3/3"], progress
    assert all("elapsed" in line and "eta" in line and "success" in line and "kl" in line for line in progress)
    assert "\r" not in run.stdout + run.stderr and "rollout step" not in run.stdout + run.stderr  # no bars
    assert "max_quarantine_fraction" not in run.stdout  # the resolved config is not printed...
    config = OmegaConf.load(run_dir / "config.yaml")  # ... but written, every key resolved
    assert config.trainer.max_steps == 3 and config.model.tiny.dir == str(warm_tiny) and "${" not in str(config)
    assert not (run_dir / "train.log").exists()
    assert not list(scratch.glob("canopy-envs-*"))  # the pool's workers and scratch folder are gone


def test_in_a_terminal_one_step_bar_and_the_rollout_bar_update_in_place(tmp_path, warm_tiny):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: make system installs it (SYSTEM_PACKAGES)")
    run_dir, done = tmp_path / "run", tmp_path / "done"
    args = train_args(warm_tiny, run_dir, 6, "data.tasks_per_step=8", "algorithm.group_size=16", "print_config=true")
    command = f"cd {ROOT} && {sys.executable} train.py {' '.join(args)}; touch {done}; sleep 300"
    session = f"canopy-console-{tmp_path.name}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", command], check=True)
    screens = []
    try:
        deadline = time.monotonic() + 600
        while not done.exists() and time.monotonic() < deadline:
            screens.append(capture(session, "-"))  # what the terminal shows now
            time.sleep(0.1)
        history = capture(session, "-", "-S", "-")  # the whole scrollback at the end
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    assert done.exists() and "final policy (HF format)" in history, history[-3000:]
    for screen in screens:  # at every moment at most one step bar and one rollout bar
        bars = [line for line in screen.splitlines() if line.startswith(("step:", "rollout step"))]
        assert sum(b.startswith("step:") for b in bars) <= 1 and sum(b.startswith("rollout") for b in bars) <= 1
    # the rollout bar sits beneath the step bar (what it shows: tests/test_agent_loop.py)
    assert any("step:" in s and "rollout step" in s for s in screens), [s[-600:] for s in screens[-6:]]
    lines = history.splitlines()
    assert sum(line.startswith("step:") for line in lines) == 1 and "6/6" in next(
        li for li in lines if li.startswith("step:")
    )
    assert not any(line.startswith("rollout step") for line in lines) and "Epoch" not in history
    assert "max_quarantine_fraction" in history  # print_config=true prints the resolved config


def capture(session: str, *args: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session, *args[1:]], capture_output=True,
                          text=True).stdout  # fmt: skip
