"""The embedded default, whole: `python train.py` at a baseline git revision and at this tree, back to back.

    python bench/embedded_default.py [--baseline-rev a5bf65e] [--rounds 1] [train.py overrides ...]

The baseline runs from a temporary git worktree of `--baseline-rev` (sharing this tree's `.cache`, so both train the
same tiny checkpoint); each round runs the baseline, then this tree (`--rounds 2` runs them again in the opposite
order). Printed per run: wall time, the median per-step phase times from TensorBoard (`time/generation`, `env`,
`reference`, `update`), the prefill tokens per step where the run logs them, and the end-of-run summary (success on
the training tasks, base vs final); then each median of this tree's runs over the baseline's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canopy.reports.tb_scalars import read_scalars  # noqa: E402

PHASES = ["time/generation", "time/env", "time/reference", "time/update", "engine/prefill_tokens"]


def run(tree: Path, out: Path, overrides: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={out}", *overrides],
        cwd=tree,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - began
    scalars = read_scalars(out / "tensorboard")
    medians = {tag: statistics.median(v for _, v in scalars[tag]) for tag in PHASES if tag in scalars}
    summary = json.loads((out / "summary.json").read_text())
    return {"wall": wall, **medians, "base": summary["base"]["all"], "final": summary["final"]["all"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-rev", default="a5bf65e")
    parser.add_argument("--rounds", type=int, default=1)
    args, overrides = parser.parse_known_args()
    results = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory(prefix="canopy-bench-") as scratch:
        baseline = Path(scratch) / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(baseline), args.baseline_rev], cwd=ROOT, check=True
        )
        try:
            (ROOT / ".cache").mkdir(exist_ok=True)
            (baseline / ".cache").symlink_to(ROOT / ".cache")
            for round_ in range(args.rounds):
                order = [("baseline", baseline), ("this tree", ROOT)]
                for name, tree in order if round_ % 2 == 0 else order[::-1]:
                    result = run(tree, Path(scratch) / f"{name.replace(' ', '_')}-{round_}", overrides)
                    results[name].append(result)
                    print(f"{name:<10} " + "  ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=False)
    print(f"\nthis tree against the baseline ({args.baseline_rev}), medians over {args.rounds} round(s):")
    for key in ["wall", *PHASES]:
        theirs, ours = ([r[key] for r in results[name] if key in r] for name in ("baseline", "this tree"))
        if theirs and ours:
            before, after = statistics.median(theirs), statistics.median(ours)
            print(f"  {key:<24} {before:>9.3f} -> {after:>9.3f}   {before / after:.2f}x as fast")
    for key in ("base", "final"):  # success on the training tasks, all tiers
        print(f"  success {key:<16} " + "   ".join(f"{n} {[round(r[key], 3) for r in results[n]]}" for n in results))


if __name__ == "__main__":
    main()
