"""bench/step_overhead.py's summary, on hand-built runs: per phase the medians before and after, their ratio, and the
median of the lockstep pairs' ratios; the warm-up steps left out; start-up and memory per process."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from step_overhead import PHASES, summarize  # noqa: E402


def run(step_seconds: list[float], startup: float, rss: float) -> dict:
    steps = [{phase: seconds / len(PHASES) for phase in PHASES} | {"step": seconds} for seconds in step_seconds]
    return {"steps": steps, "startup": startup, "startup_rss_mb": rss, "peak_rss_mb": 2 * rss}


def test_ratios_are_of_medians_and_of_pairs_past_the_warm_up():
    before = [run([9.0, 1.0, 2.0, 3.0], startup=6.0, rss=500.0), run([9.0, 1.0, 2.0, 3.0], startup=8.0, rss=520.0)]
    after = [run([1.0, 3.0, 1.0, 2.0], startup=4.0, rss=400.0), run([1.0, 3.0, 1.0, 2.0], startup=4.0, rss=420.0)]
    lines = summarize({"baseline": before, "this tree": after}, skip=1)
    step = next(line for line in lines if line.startswith("| step |")).split("|")
    # past the first step both medians are 2, but step for step the pairs are 1/3, 2/1 and 3/2: median 1.5
    assert [cell.strip() for cell in step[2:6]] == ["2.0000", "2.0000", "1.00x", "1.50x"]
    startup = next(line for line in lines if line.startswith("| launch to the first step")).split("|")
    assert [cell.strip() for cell in startup[2:5]] == ["7.00", "4.00", "1.75x"]
    peak = next(line for line in lines if line.startswith("| peak RSS")).split("|")
    assert [cell.strip() for cell in peak[2:5]] == ["1020.00", "820.00", "1.24x"]
