"""The trajectory log's writer process, started by `canopy.trajectories.TrajectoryLog`:

    python -m canopy.trajectory_writer

On stdin, pickled: its `Writer`, then each step to write, then None (or the end of input: the training process
died). On stdout, what it has to say, a JSON line each. It imports only what writing the logs needs: not torch,
Lightning or the run's script (a `multiprocessing` spawn re-imported the script and all it imports, ~0.5 GB).
"""

import os
import pickle
import signal
import sys


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run, which then closes the log: all written
    said = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything else printed goes to stderr, not in what it says
    steps = sys.stdin.buffer
    pickle.load(steps).run(steps, said)


if __name__ == "__main__":
    main()
