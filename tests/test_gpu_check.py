"""The prepared sharding check runs its whole code path tiny on CPU: one rank, then TP (Qwen3) or FSDP (Qwen3.5) on 2
gloo processes compared. The Qwen3.5 kernel check's dry run is part of tests/test_device_check.py."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def dry_run(script: str, *args: str, timeout: int = 900) -> list[str]:
    """`python scripts/<script> --cpu-dry-run ARGS`, which must pass; returns its output lines."""
    run = subprocess.run(
        [sys.executable, f"scripts/{script}", "--cpu-dry-run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout.strip().splitlines()


@pytest.mark.slow
def test_gpu_check_cpu_dry_run_passes():
    lines = dry_run("gpu_check_parallel.py", "--steps", "3")
    assert lines[-1] == "gpu_check_parallel: PASS"
    speeds = [line for line in lines if line.strip().startswith("step time")]
    assert len(speeds) == 2  # (a) one rank and (b) the sharded run
    for line in speeds:
        step_time, tokens_per_s = re.search(r"step time ([\d.]+) s, ([\d,]+) tokens/s, MFU n/a", line).groups()
        assert float(step_time) > 0 and int(tokens_per_s.replace(",", "")) > 0
    assert "(b) dp_shard=1 x tp=2 x cp=1 against one rank" in lines
    assert "  matches one rank" in lines


@pytest.mark.slow
def test_gpu_check_for_qwen3_5_cpu_dry_run_passes():
    """`--family qwen3_5`: a random Qwen3.5 through the real update on one rank, then FSDP on 2 gloo processes."""
    lines = dry_run("gpu_check_parallel.py", "--family", "qwen3_5", "--steps", "3")
    assert lines[-1] == "gpu_check_parallel: PASS"
    assert "(b) dp_shard=2 x tp=1 x cp=1 against one rank" in lines and "  matches one rank" in lines
