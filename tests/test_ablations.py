"""bench/ablations.py end to end at a tiny step count: both variants run and the Table A2 / Fig. 6 outputs appear."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ablations_table_and_figure(tmp_path):
    command = [
        sys.executable,
        "bench/ablations.py",
        "--steps",
        "1",
        "--eval-k",
        "1",
        "--variants",
        "no_kl",
        "--out",
        str(tmp_path),
        f"model.tiny.dir={tmp_path / 'tiny'}",
        "model.tiny.format_warmup_steps=30",
        "data.tasks_per_step=2",
        "algorithm.group_size=4",
        "eval.split=test",
    ]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (
        "| Variant | train success | dev TGC m@1 | entropy | clip frac | grad norm (mean) | grad norm (final) | "
        "engine gap |" in run.stdout
    )
    rows = json.loads((tmp_path / "ablations.json").read_text())
    assert [r["variant"] for r in rows] == ["recipe", "no_kl"]
    assert all(r["engine_gap"] < 1e-5 and r["grad_norm_mean"] > 0 and 0 <= r["score"] <= 1 for r in rows)
    for name in ("ablations.md", "fig6_ablations.png", "fig4_kl_anchor.png"):
        assert (tmp_path / name).stat().st_size > 0, name
