"""FSDP2 / TP / FSDP x TP on CPU (gloo) against one process: same loss and gradients within 1e-5 in fp32
(gradients relative to each tensor's largest entry)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2), (2, 2)], ids=["fsdp2", "tp2", "fsdp2xtp2"])
def test_sharded_policy_matches_single_process(tiny_path_even_vocab, tmp_path, dp, tp):
    world = dp * tp
    run = subprocess.run(
        [sys.executable, "-m", "tests.parallel_worker", str(world), str(free_port()), str(tiny_path_even_vocab), str(dp), str(tp),
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(world):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["weight_diff"] == 0.0  # sharded loading is exact
        assert abs(result["loss"] - result["full_loss"]) < 1e-5
        assert result["grad_diff"] < 1e-5
