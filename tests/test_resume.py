"""Exact resume: a run killed with SIGKILL and resumed from its last checkpoint repeats the uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from canopy.tools.tb_scalars import read_scalars

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6  # a checkpoint at step 4 and two steps after it


def command(run_dir, model, *overrides):
    return [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        f"model.tiny.dir={model}",
        "model.tiny.format_warmup_steps=30",
        f"trainer.max_steps={STEPS}",
        "data.tasks_per_step=4",
        "algorithm.group_size=4",
        "report.eval_samples_per_task=0",
        *overrides,
    ]


def losses(run_dir):
    return {step: value for step, value in read_scalars(run_dir / "tensorboard")["actor/loss"]}


@pytest.mark.slow
def test_kill_9_then_resume_repeats_the_uninterrupted_run(tmp_path, warm_tiny):
    model = warm_tiny
    subprocess.run(command(tmp_path / "a", model), cwd=ROOT, check=True, capture_output=True, timeout=900)
    reference = losses(tmp_path / "a")

    victim = subprocess.Popen(
        command(tmp_path / "b", model, "checkpoint.every_n_steps=2"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpoints = tmp_path / "b" / "checkpoints"
    deadline = time.time() + 600
    while not (checkpoints / "step4.ckpt").exists():
        assert victim.poll() is None and time.time() < deadline, "the run ended before its step-4 checkpoint"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()

    last = checkpoints / "last.ckpt"
    resumed_from = torch.load(last, weights_only=False)["global_step"]  # a complete file despite the kill
    assert resumed_from in (2, 4)  # step4.ckpt may be written before last.ckpt catches up
    subprocess.run(
        command(tmp_path / "c", model, f"checkpoint.resume={last}"),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=900,
    )
    resumed = losses(tmp_path / "c")
    assert sorted(resumed) == list(range(resumed_from, STEPS))
    for step, value in resumed.items():
        assert value == pytest.approx(reference[step], abs=1e-6), step


@pytest.mark.slow
def test_sharded_checkpoint_resume_on_two_processes(tmp_path, warm_tiny):
    """FSDP on 2 processes writes a sharded (DCP) checkpoint; resuming from it repeats the remaining steps."""
    model, sharded = warm_tiny, ["trainer.devices=2", "parallelism.dp_shard=2"]
    subprocess.run(
        command(tmp_path / "a", model, *sharded, "checkpoint.every_n_steps=4"),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=900,
    )
    checkpoint = tmp_path / "a" / "checkpoints" / "step4.ckpt"
    assert checkpoint.is_dir() and list(checkpoint.glob("*.distcp"))  # one shard file per rank
    subprocess.run(
        command(tmp_path / "b", model, *sharded, f"checkpoint.resume={checkpoint}"),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=900,
    )
    reference, resumed = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(resumed) == list(range(4, STEPS))
    for step, value in resumed.items():
        assert value == pytest.approx(reference[step], abs=1e-6), step


# Loaded by every rank of a train.py run through PYTHONPATH: the ranks finish writing the step-4 sharded checkpoint
# (shards and DCP's .metadata) and are killed before Lightning's meta.pt, the worst moment for a half-written save.
KILL_AFTER_STEP4_SHARDS = """
import os, signal
import lightning.pytorch.strategies.model_parallel as model_parallel
save = model_parallel._distributed_checkpoint_save
def save_then_die(state, path):
    save(state, path)
    if path.name.startswith("step4"):
        os.kill(os.getpid(), signal.SIGKILL)
model_parallel._distributed_checkpoint_save = save_then_die
"""


@pytest.mark.slow
def test_interrupted_sharded_save_leaves_no_checkpoint_and_is_cleaned_up(tmp_path, warm_tiny):
    """A kill in the middle of a DCP save leaves only `<name>.tmp`; resuming from it fails with a one-line error
    naming the fix; the next save removes it and publishes complete checkpoints."""
    model, sharded = warm_tiny, ["trainer.devices=2", "parallelism.dp_shard=2", "checkpoint.every_n_steps=2"]
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(KILL_AFTER_STEP4_SHARDS)
    killed = subprocess.run(
        command(tmp_path / "a", model, *sharded),
        cwd=ROOT,
        capture_output=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "inject")},
    )
    assert killed.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "a" / "checkpoints"
    partial = checkpoints / "step4.ckpt.tmp"
    assert (partial / ".metadata").is_file() and not (partial / "meta.pt").exists()  # the save did die half-way
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step2.ckpt", "step4.ckpt.tmp"]
    for complete in ("last.ckpt", "step2.ckpt"):
        assert (checkpoints / complete / ".metadata").is_file() and (checkpoints / complete / "meta.pt").is_file()

    refused = subprocess.run(
        command(tmp_path / "b", model, *sharded, f"checkpoint.resume={partial}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0
    assert (
        refused.stderr.strip().splitlines()[-1].startswith(f"config error: checkpoint.resume '{partial}' is a sharded")
    )
    assert "resume from an earlier complete one" in refused.stderr

    # resume into the same run directory: its next save clears the leftover and replaces last.ckpt whole
    subprocess.run(
        command(
            tmp_path / "a", model, *sharded, "trainer.max_steps=4", f"checkpoint.resume={checkpoints / 'last.ckpt'}"
        ),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=900,
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step2.ckpt", "step4.ckpt"]
    assert torch.load(checkpoints / "last.ckpt" / "meta.pt", weights_only=False)["global_step"] == 4


def test_resume_from_an_unfinished_sharded_checkpoint_is_refused(tmp_path):
    from canopy.config import ConfigError, validate
    from tests.test_config import config

    (tmp_path / "step4.ckpt.tmp").mkdir()
    (tmp_path / "step4.ckpt.tmp" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"did not finish \(no \.metadata or meta\.pt\): resume from an earlier"):
        validate(config(f"checkpoint.resume={tmp_path / 'step4.ckpt.tmp'}"))
