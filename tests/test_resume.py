"""Exact resume: a run killed with SIGKILL and resumed from its last checkpoint repeats the uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from canopy.config import validate
from canopy.errors import ConfigError
from canopy.reports.tb_scalars import read_scalars
from tests.helpers import config

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


def run(run_dir, model, *overrides):
    subprocess.run(command(run_dir, model, *overrides), cwd=ROOT, check=True, capture_output=True, timeout=900)


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
SHARDED = ["trainer.devices=2", "parallelism.dp_shard=2"]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory, warm_tiny):
    """FSDP on 2 processes: (a) the uninterrupted reference, writing a sharded (DCP) checkpoint at step 4; (b) a run
    checkpointing every 2 steps, killed in the middle of its step-4 save, then resumed in the same run directory
    from its last complete checkpoint to the end. What the kill left is recorded before the resume."""
    folder = tmp_path_factory.mktemp("sharded")
    run(folder / "a", warm_tiny, *SHARDED, "checkpoint.every_n_steps=4")
    (folder / "inject").mkdir()
    (folder / "inject" / "sitecustomize.py").write_text(KILL_AFTER_STEP4_SHARDS)
    killed = subprocess.run(
        command(folder / "b", warm_tiny, *SHARDED, "checkpoint.every_n_steps=2"),
        cwd=ROOT,
        capture_output=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(folder / "inject")},
    )
    checkpoints = folder / "b" / "checkpoints"
    left = {path.name: sorted(p.name for p in path.iterdir()) for path in checkpoints.iterdir()}
    try:
        validate(config(f"checkpoint.resume={checkpoints / 'step4.ckpt.tmp'}"))
        refusal = None
    except ConfigError as error:
        refusal = str(error)
    (folder / "b" / "tensorboard").rename(folder / "killed-tensorboard")  # what the resumed run logs, alone
    last = checkpoints / "last.ckpt"
    resumed_from = torch.load(last / "meta.pt", weights_only=False)["global_step"]
    run(folder / "b", warm_tiny, *SHARDED, "checkpoint.every_n_steps=2", f"checkpoint.resume={last}")
    return dict(folder=folder, killed=killed.returncode, left=left, refusal=refusal, resumed_from=resumed_from)


@pytest.mark.slow
def test_sharded_checkpoint_resume_on_two_processes(sharded_runs):
    """Resuming an FSDP run from its sharded checkpoint repeats the remaining steps of the uninterrupted run."""
    folder = sharded_runs["folder"]
    checkpoint = folder / "a" / "checkpoints" / "step4.ckpt"
    assert checkpoint.is_dir() and list(checkpoint.glob("*.distcp"))  # one shard file per rank
    assert sharded_runs["resumed_from"] == 2
    reference, resumed = losses(folder / "a"), losses(folder / "b")
    assert sorted(resumed) == list(range(sharded_runs["resumed_from"], STEPS))
    for step, value in resumed.items():
        assert value == pytest.approx(reference[step], abs=1e-6), step


@pytest.mark.slow
def test_interrupted_sharded_save_leaves_no_checkpoint_and_is_cleaned_up(sharded_runs):
    """A kill in the middle of a DCP save leaves only `<name>.tmp`; resuming from it fails with a one-line error
    naming the fix; the next save removes it and publishes complete checkpoints."""
    assert sharded_runs["killed"] == -signal.SIGKILL
    left = sharded_runs["left"]
    assert sorted(left) == ["last.ckpt", "step2.ckpt", "step4.ckpt.tmp"]
    assert ".metadata" in left["step4.ckpt.tmp"] and "meta.pt" not in left["step4.ckpt.tmp"]  # died half-way
    for complete in ("last.ckpt", "step2.ckpt"):
        assert {".metadata", "meta.pt"} <= set(left[complete])
    partial = sharded_runs["folder"] / "b" / "checkpoints" / "step4.ckpt.tmp"
    assert sharded_runs["refusal"].startswith(f"checkpoint.resume '{partial}' is a sharded")
    assert "resume from an earlier complete one" in sharded_runs["refusal"]

    # the resume into the same run directory: its next save cleared the leftover and replaced last.ckpt whole
    checkpoints = sharded_runs["folder"] / "b" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step2.ckpt", "step4.ckpt", "step6.ckpt"]
    assert torch.load(checkpoints / "last.ckpt" / "meta.pt", weights_only=False)["global_step"] == STEPS


def test_resume_from_an_unfinished_sharded_checkpoint_is_refused(tmp_path):
    (tmp_path / "step4.ckpt.tmp").mkdir()
    (tmp_path / "step4.ckpt.tmp" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"did not finish \(no \.metadata or meta\.pt\): resume from an earlier"):
        validate(config(f"checkpoint.resume={tmp_path / 'step4.ckpt.tmp'}"))


def test_resume_takes_only_a_training_checkpoint_and_names_what_to_pass(tmp_path, tiny_path):
    """A file that is not torch.save's archive of a Lightning checkpoint (a README, a plain weights file, a truncated
    .ckpt) is refused at validate in one line, without loading it; a finished HF export is told to start a new run
    with model.path, and that fix validates; a Lightning .ckpt and a finished sharded checkpoint pass."""
    torch.save({"state_dict": {"policy.w": torch.zeros(64)}, "global_step": 2}, tmp_path / "last.ckpt")
    torch.save({"w": torch.zeros(64)}, tmp_path / "weights.pt")
    (tmp_path / "cut.ckpt").write_bytes((tmp_path / "last.ckpt").read_bytes()[:-64])
    for name in ("weights.pt", "cut.ckpt"):
        with pytest.raises(ConfigError) as error:
            validate(config(f"checkpoint.resume={tmp_path / name}"))
        assert str(error.value) == (
            f"checkpoint.resume '{tmp_path / name}' is not a Lightning checkpoint (a .ckpt file, or a sharded "
            "checkpoint directory with .metadata and meta.pt): pass a checkpoint written by checkpoint.every_n_steps "
            "(e.g. <run dir>/checkpoints/last.ckpt)"
        )
    with pytest.raises(ConfigError, match="'README.md' is not a Lightning checkpoint"):
        validate(config("checkpoint.resume=README.md"))
    with pytest.raises(ConfigError) as error:
        validate(config(f"checkpoint.resume={tiny_path}"))
    assert str(error.value).startswith(f"checkpoint.resume '{tiny_path}' is an HF model export")
    fix = str(error.value).rpartition(" with ")[2]
    assert fix == f"model.path={tiny_path}"
    validate(config(fix))
    sharded = tmp_path / "step4.ckpt"
    sharded.mkdir()
    for name in (".metadata", "meta.pt", "__0_0.distcp"):
        (sharded / name).write_bytes(b"")
    validate(config(f"checkpoint.resume={tmp_path / 'last.ckpt'}"))
    validate(config(f"checkpoint.resume={sharded}"))
