"""Build a run's rollout viewer page, <run>/viewer.html (the page itself: canopy/reports/viewer.py).

The rollout viewer callback (canopy/callbacks/rollout_viewer.py) runs it in a process of its own at idle priority: it
imports neither torch nor the training code.

    python -m canopy.tools.viewer <run dir> <steps> <max chars>
"""

import argparse

from canopy.reports.viewer import build_viewer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int, help="the last logged steps of each stream the page browses")
    parser.add_argument("max_chars", type=int, help="longer texts are cut to this many characters")
    args = parser.parse_args()
    build_viewer(args.run_dir, args.steps, args.max_chars)


if __name__ == "__main__":
    main()
