"""Fault soak (Appendix G): `python bench/fault_soak.py --episodes 2000 --workers 8`.

Runs episodes through the real worker pool, sandbox and agent loop with faults of every kind injected (kill -9,
hang, worker OOM, worker crash, cross-episode corruption, environment bug; the agent's infinite loop, sleep,
memory bomb, fork bomb, crash and syntax error; escape attempts) and ends with the line
`faults: N injected, N quarantined, N agent-failed, M misclassified, L lost` (M and L must be 0), then the two
directions of attribution by kind, `attribution: A agent endings quarantined (...), S serving faults scored (...)`
(both must be 0; each is also misclassified). Exits non-zero if anything was misclassified or lost.

`--swe` runs the SWE-bench mode instead (`python bench/fault_soak.py --swe --episodes 500 --workers 4`; needs
bubblewrap): generated SWE tasks with SWE-bench's serving faults and the agent's own (`canopy.tools.fault_soak`), and
prints the latency percentiles of sandbox starts, commands and grading.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canopy.tools.fault_soak import attribution_line, latency_lines, soak, soak_line, swe_soak  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--fault-rate", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--swe", action="store_true", help="the SWE-bench mode")
    args = parser.parse_args()
    counts, rows = (swe_soak if args.swe else soak)(args.episodes, args.workers, args.fault_rate, args.seed)
    for job, trajectory, observed in rows:
        if observed != job.expected:
            print(
                f"  {job.task.task_id} phase={job.task.spec.get('phase')}: expected {job.expected}, got {observed} "
                f"(ending {trajectory.ending}, quarantine {trajectory.quarantine}, agent failure "
                f"{trajectory.agent_failure})"
            )
    print(
        f"{args.episodes} episodes, {args.workers} workers, {counts['seconds']:.0f} s "
        f"({args.episodes / counts['seconds']:.1f} episodes/s), {counts['repairs']} workers repaired at health checks"
    )
    print("endings: " + ", ".join(f"{reason} {n}" for reason, n in counts["endings"].most_common()))
    for line in latency_lines(counts.get("latency", {})):
        print(line)
    print(soak_line(counts))
    print(attribution_line(counts))
    sys.exit(1 if counts["misclassified"] or counts["lost"] else 0)


if __name__ == "__main__":
    main()
