"""bench/logprob_head.py at tiny sizes: it runs both paths, they agree, and the chunked head's peak is below the
whole logits'."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_runs_and_the_chunked_head_needs_less_memory():
    args = ["--tokens", "256", "512", "--vocab", "3000", "--hidden", "32", "--chunk", "64", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, "bench/logprob_head.py", *args, "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "logprobs agree" in done.stdout, done.stdout
    lines = [line.split() for line in done.stdout.splitlines()]
    rows = {fields[0]: fields[1:] for fields in lines if fields[:1] in (["256"], ["512"])}
    assert set(rows) == {"256", "512"}, done.stdout
    whole, chunked, ratio = float(rows["512"][0]), float(rows["512"][1]), float(rows["512"][2].rstrip("x"))
    assert chunked < whole and ratio < 0.5, done.stdout  # ~5 copies of 512 rows of logits against ~2 of 64
