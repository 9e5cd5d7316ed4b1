"""A broken setup is not quarantine (Appendix G): quarantine is for rare exogenous faults.

`check_systemic_faults` looks at one step's (or one evaluation's) episodes and stops the run when the serving
layer is failing systematically, with one line that names the dominant fault reason, the first such fault's
message (which names the log to read) and what to do:
- most episodes were quarantined: the quarantined fraction exceeds `max_fraction` (`env.max_quarantine_fraction`);
- the same fault repeats on every worker: one reason quarantined at least `REPEATS` episodes on each worker of
  a pool of two or more (a worker is replaced after every fault, so the fault survived restarts everywhere).
"""

from collections import Counter

from canopy.envs.base import SystemicFaultError
from canopy.rollout.trajectory import Trajectory

REPEATS = 2


def check_systemic_faults(trajectories: list[Trajectory], max_fraction: float, workers: int | None, what: str) -> None:
    """Raise `SystemicFaultError` when `trajectories` show a systematic serving fault (see the module docstring).
    `workers` is the pool's worker count (None for an in-process environment); `what` names the step."""
    quarantined = [t for t in trajectories if t.quarantine is not None]
    if not quarantined:
        return
    reasons = Counter(t.quarantine for t in quarantined)
    reason, count = reasons.most_common(1)[0]
    if len(quarantined) > max_fraction * len(trajectories):
        why = (
            f"{len(quarantined)} of {len(trajectories)} episodes of {what} were quarantined "
            f"(> env.max_quarantine_fraction={max_fraction})"
        )
    else:
        per_worker = Counter((t.quarantine, t.fault.worker) for t in quarantined if t.fault.worker is not None)
        everywhere = [
            r for r in reasons if workers and workers >= 2 and all(per_worker[r, w] >= REPEATS for w in range(workers))
        ]
        if not everywhere:
            return
        reason, count = everywhere[0], reasons[everywhere[0]]
        why = f"in {what} the fault {reason} quarantined >= {REPEATS} episodes on every one of the {workers} workers"
    first = next(t for t in quarantined if t.quarantine == reason)
    detail = " ".join(first.fault.detail.split()) if first.fault is not None and first.fault.detail else "(no detail)"
    raise SystemicFaultError(
        f"the environment's serving layer is failing, not the agent: {why}; {count} of them {reason}; first: {detail}. "
        "Fix the environment's setup (quarantine is for rare faults); raise env.max_quarantine_fraction only for "
        "faults that are truly exogenous"
    )
