"""The fault soak's SWE mode (`canopy.tools.fault_soak.swe_soak`, `bench/fault_soak.py --swe`): every serving fault
quarantined for its reason, every agent fault given its Table A3 outcome, nothing lost, latencies recorded."""

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (make system)")


@pytest.mark.slow
def test_swe_soak_misclassifies_and_loses_nothing():
    from canopy.tools.fault_soak import SWE_KINDS, attribution_line, latency_lines, soak_line, swe_soak

    counts, rows = swe_soak(episodes=56, workers=2, fault_rate=0.8, seed=0)
    print(soak_line(counts), attribution_line(counts), *latency_lines(counts["latency"]), sep="\n")
    assert not counts["agent_quarantined"] and not counts["serving_scored"], attribution_line(counts)
    assert {job.kind for job, _, _ in rows} == {*SWE_KINDS, "clean"}  # every kind, and clean episodes
    assert counts["misclassified"] == 0 and counts["lost"] == 0
    assert counts["quarantined"] == sum(job.expected.startswith("quarantined:") for job, _, _ in rows)
    assert {"sandbox_start", "command", "grading_command", "grading"} <= set(counts["latency"])
    assert not any(Path(path).exists() for path in ("/usr/canopy-escape", "/etc/canopy-escape"))
    assert soak_line(counts).endswith("0 misclassified, 0 lost")
