"""Where a run's rollouts went, read from its trajectory logs (`canopy/trajectories.py`): per logged training step and
tier, the rollouts, successes and mixed groups (Eq. 4's informative ones), and with `--tasks` each group's task, its
success estimate before the step and its size. The estimates are replayed through `SuccessEstimates`, the ones
`algorithm.group_size=auto` sizes its groups by (`--decay` must be the run's `adaptive_group.decay`); the replay is
exact when every training step and group was logged (`trajectories.every_n_steps=1`, the default), and the command
says when it was not. Issue 32 found with it why an auto run never took off: most of each step went to a task it
could not solve.

    python -m canopy.tools.group_sizes <run dir> [--every 10] [--tasks] [--decay 0.5]
"""

import argparse
from collections import defaultdict
from pathlib import Path

from canopy.coverage import SuccessEstimates, group_composition
from canopy.trajectories import read_step, step_files


def replay(run_dir: str | Path, decay: float = 0.5) -> list[dict]:
    """Per logged training step: `step`, `tiers` ({tier: {rollouts, successes, groups, mixed}}) and `groups` (task,
    tier, the task's estimate before the step, rollouts scored, successes), quarantined episodes left out."""
    estimates, steps = SuccessEstimates(decay), []
    for step, path in step_files(Path(run_dir) / "trajectories" / "train").items():
        by_group: dict[tuple, list[dict]] = defaultdict(list)
        for record in read_step(path):
            if record["quarantine"] is None:
                by_group[(record["group"], record["task_id"], record["tier"])].append(record)
        groups = []
        for (_, task, tier), records in sorted(by_group.items()):
            successes = sum(bool(r["verdict"] and r["verdict"]["success"]) for r in records)  # as step_summary
            groups.append({"task": task, "tier": tier, "estimate": estimates.rate(task, tier), "n": len(records),
                           "successes": successes})  # fmt: skip
        tiers: dict[int, dict[str, int]] = {}
        for g in groups:
            row = tiers.setdefault(g["tier"], {"rollouts": 0, "successes": 0, "groups": 0, "mixed": 0})
            row["rollouts"] += g["n"]
            row["successes"] += g["successes"]
            row["groups"] += 1
            row["mixed"] += group_composition(g["successes"], g["n"]) == "mixed"
        for g in groups:
            estimates.observe(g["task"], g["tier"], g["successes"], g["n"])
        steps.append({"step": step, "tiers": dict(sorted(tiers.items())), "groups": groups})
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--every", type=int, default=10, help="print every n-th logged step")
    parser.add_argument("--tasks", action="store_true", help="also each group: task, estimate, size, successes")
    parser.add_argument("--decay", type=float, default=0.5, help="the run's algorithm.adaptive_group.decay")
    args = parser.parse_args(argv)
    steps = replay(args.run_dir, args.decay)
    if not steps:
        raise SystemExit(f"no training steps logged under {args.run_dir / 'trajectories' / 'train'}")
    numbers = [s["step"] for s in steps]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        print("note: some training steps were not logged, so the replayed estimates are approximate")
    for s in steps[:: args.every]:
        cells = "  ".join(
            f"tier{tier}: {r['rollouts']:3d} rollouts, {r['successes']:3d} successes, {r['mixed']}/{r['groups']} mixed"
            for tier, r in s["tiers"].items()
        )
        print(f"step {s['step']:4d}  {cells}")
        for g in s["groups"] if args.tasks else ():
            estimate, n = f"p^ {g['estimate']:.3f}", f"n {g['n']:3d}"
            print(f"    {g['task']:<24} tier{g['tier']}  {estimate}  {n}  successes {g['successes']}")


if __name__ == "__main__":
    main()
