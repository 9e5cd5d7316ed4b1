"""Fault soak (Appendix G): many episodes through the real worker pool and agent loop with faults of every
kind injected, each episode's ending checked against the class its fault must produce.

Serving-layer faults (`canopy.envs.fault_injection`) must be quarantined. Agent faults, sent by the scripted
agent as code (infinite loop, sleep, memory bomb, fork bomb, its own crash, a syntax error), must be scored 0
and never quarantined. Escape episodes try to write outside their scratch dir, reach the network and kill
their worker, then solve the task: they must succeed and see every attempt blocked. Clean episodes must
succeed. An episode with no ending, or in a run that raised, is lost.

SWE mode (`swe_soak`): SWE-bench episodes (generated tasks, bubblewrap sandboxes, swebench grading) with the
serving faults of `canopy.envs.swe_fault_injection`, each to be quarantined for its reason, and the agent's own
faults, each to get its Table A3 outcome and reward: a wrong fix (unresolved), no submission, an empty patch and a
garbage diff (-0.2); format errors, a command past its timeout, an OOM-killed command, a fork bomb, a network
attempt and a write outside the sandbox are observations, after which the agent resolves the task. Tampering agents
submit attacks of `canopy.tools.swe_attacks` (a conftest hook, a plugin, a git hook ...): each must be graded
unresolved with what it tampered with restored. It reports the latency percentiles of sandbox starts, commands and
grading.
"""

import json
import os
import random
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from canopy.envs.base import Task
from canopy.envs.fault_injection import EPISODE_PHASES, INFRA_FAULTS, NEEDS_ROOT
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.envs.swe_fault_injection import SERVING_FAULTS
from canopy.envs.swebench import NO_PATCH_OUTCOMES
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.engine import Generation, SamplingParams
from canopy.rollout.trajectory import Trajectory
from canopy.tiny_model import build_byte_tokenizer
from canopy.tools.swe_attacks import ATTACKS, Repo
from canopy.tools.swe_data.generate import generate

AGENT_CODE = {
    "agent_loop": "while True:\n    pass",
    "agent_sleep": "import time\ntime.sleep(3600)",
    "agent_memory": "hog = bytearray(64 * 2**30)",
    "agent_fork": "import os\nwhile True:\n    os.fork()",
    "agent_crash": "import os\nos.abort()",
    "agent_syntax": "def broken(:\n    pass",
    "agent_kill_self": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "agent_answer_socket": "import socket\nsocket.socket(socket.AF_UNIX).bind('answer.txt')\n"
    "open('.submitted', 'w').close()",  # issue 44: the verdict's open once raised (a quarantine)
    "agent_deep_tree": "import os\nopen('.submitted', 'w').close()\nfor _ in range(3000):\n    os.mkdir('d')\n"
    "    os.chdir('d')",  # deeper than a recursive removal goes (once failed every later pool's start)
}
AGENT_FAULTS = tuple(AGENT_CODE)
ESCAPE = "agent_escape"
ESCAPE_CODE = """import os, signal, socket
for attempt in (lambda: open('/tmp/canopy-escape', 'w').write('x'),
                lambda: socket.create_connection(('1.1.1.1', 80), timeout=1),
                lambda: os.kill(os.getppid(), signal.SIGKILL)):
    try:
        attempt()
        print('ESCAPED')
    except OSError as error:
        print('blocked:', error)
"""
EPISODE_TAG = re.compile(r"\[episode (\S+)\]")


@dataclass(frozen=True)
class SoakJob:
    task: Task
    kind: str  # clean | one of INFRA_FAULTS, AGENT_FAULTS | ESCAPE; SWE mode: clean | one of SWE_KINDS
    expected: str  # quarantined | agent_scored_0 | success; SWE mode: an outcome | quarantined:<reason>


def serving_faults() -> tuple[str, ...]:
    """The serving faults this machine can inject (a full scratch filesystem needs root to mount a small one)."""
    return tuple(kind for kind in INFRA_FAULTS if kind not in NEEDS_ROOT or os.geteuid() == 0)


def soak_jobs(count: int, fault_rate: float, seed: int, base_tasks: list[Task]) -> list[SoakJob]:
    """`count` episodes, a `fault_rate` share of them with a fault; kinds and phases drawn uniformly."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        base = rng.choice(base_tasks)
        kind = rng.choice(serving_faults() + AGENT_FAULTS + (ESCAPE,)) if rng.random() < fault_rate else "clean"
        spec = dict(base.spec)
        if kind in INFRA_FAULTS:
            spec.update(
                inject=kind,
                phase=rng.choice(("step", "verdict") if kind in EPISODE_PHASES else ("start", "step", "verdict")),
            )
        expected = "quarantined" if kind in INFRA_FAULTS else "agent_scored_0" if kind in AGENT_FAULTS else "success"
        jobs.append(SoakJob(Task(f"soak{i}-{kind}", base.tier, base.scenario, spec), kind, expected))
    return jobs


class SoakAgent:
    """A scripted policy behind the engine contract: it reads the episode tag in the prompt and answers with
    that episode's script (turn 1: its fault, escape attempt or an ordinary step; turn 2: the answer)."""

    concurrent = False  # a batch at a time, as `run_episodes` reads it

    def __init__(self, tokenizer, jobs: list[SoakJob]):
        self.tokenizer, self.weight_version = tokenizer, 0
        self.jobs = {job.task.task_id: job for job in jobs}
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def update_weights(self, named_tensors, version: int) -> None:
        self.weight_version = version

    def action(self, job: SoakJob, turn: int) -> str:
        if job.kind in AGENT_CODE and turn == 0:
            code = AGENT_CODE[job.kind]
        elif job.kind == "agent_syntax":
            code = "submit('not the answer')"
        elif job.kind == ESCAPE and turn == 0:
            code = ESCAPE_CODE
        elif job.kind in INFRA_FAULTS and turn == 0:
            code = "print('looking around')"
        else:
            code = f"submit({job.task.spec['answer']!r})"
        return f"```python\n{code}\n```"

    def release(self, keys):
        """Nothing is kept between turns."""

    def generate(self, prompts, max_new_tokens, sampling, keys=None) -> list[Generation]:
        out = []
        for prompt, limit in zip(prompts, max_new_tokens):
            text = self.tokenizer.decode(prompt)
            job = self.jobs[EPISODE_TAG.search(text).group(1)]
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.tokenizer.encode(self.action(job, turn), add_special_tokens=False)[: limit - 1] + [self.im_end]
            out.append(Generation(ids, [0.0] * len(ids), "stop", self.weight_version))
        return out


def escaped(trajectory: Trajectory, tokenizer) -> bool:
    """Whether an observation reports an escape attempt that got through."""
    observations = [token for token, mask in zip(trajectory.token_ids, trajectory.action_mask) if not mask]
    return "ESCAPED" in tokenizer.decode(observations[trajectory.prompt_length :])


def observed_class(trajectory: Trajectory, tokenizer) -> str:
    if escaped(trajectory, tokenizer):
        return "escaped"
    if trajectory.quarantine is not None:
        return "quarantined"
    if not trajectory.ending:
        return "lost"
    return "success" if trajectory.verdict is not None and trajectory.verdict.success else "agent_scored_0"


def soak(episodes: int, workers: int, fault_rate: float = 0.5, seed: int = 0, request_timeout_s: float = 5.0):
    """Run the soak; returns (counts, rows), rows being (job, trajectory, observed class)."""
    sandbox = {"cpu_seconds": 1, "wall_seconds": 2.0, "memory_mb": 256, "max_processes": 8}
    settings = PoolSettings(workers=workers, memory_mb=1024, request_timeout_s=request_timeout_s, health_timeout_s=2.0)
    budget = Budget(
        max_turns=3,
        max_response_tokens=4096,
        max_prompt_tokens=1024,
        max_observation_tokens=512,
        max_context_tokens=8192,
    )
    pool = EnvironmentPool("canopy.envs.fault_injection:FaultInjectingEnvironment", {"sandbox": sandbox}, settings)
    counts, rows = run_soak(
        pool,
        lambda tasks: soak_jobs(episodes, fault_rate, seed, tasks),
        SoakAgent,
        observed_class,
        budget,
        seed,
        episodes,
    )
    counts["agent_failed"] = sum(c == "agent_scored_0" and job.kind in AGENT_FAULTS for job, _, c in rows)
    return counts, rows


def run_soak(pool: EnvironmentPool, make_jobs, agent_class, classify, budget: Budget, seed: int, episodes: int):
    """Run the `episodes` jobs `make_jobs(train tasks)` through `pool` and the agent loop, played by `agent_class`'s
    scripted agent, each ending classified by `classify(trajectory, tokenizer)`; returns (counts, rows) as `soak`
    does, less its `agent_failed`. An episode with no ending, or in a run that raised, is lost."""
    started = time.monotonic()
    tokenizer = build_byte_tokenizer()
    jobs, trajectories = [], []
    try:
        jobs = make_jobs(pool.tasks("train"))
        trajectories, _ = run_episodes(
            agent_class(tokenizer, jobs),
            pool,
            tokenizer,
            [(job.task, 0) for job in jobs],
            budget,
            SamplingParams(temperature=1.0, top_p=1.0, top_k=-1),
            seed=seed,
            description="fault soak",
        )
    except Exception as error:  # a run that raised lost every episode in it
        print(f"soak aborted: {error!r}")
        trajectories = []
    finally:
        repairs = pool.repairs
        pool.close()
    classes = [classify(t, tokenizer) for t in trajectories]
    classes += ["lost"] * (episodes - len(classes))
    pairs = list(zip(jobs, classes))
    counts = {
        "injected": sum(job.kind != "clean" for job in jobs),
        "quarantined": sum(c.startswith("quarantined") for c in classes),
        "misclassified": sum(c not in (job.expected, "lost") for job, c in pairs),
        # the two ways attribution can fail, by kind: an agent ending taken for the serving layer's (Appendix G's
        # optimistic bias) and a serving fault scored as the agent's
        "agent_quarantined": Counter(
            job.kind for job, c in pairs if c.startswith("quarantined") and not job.expected.startswith("quarantined")
        ),
        "serving_scored": Counter(
            job.kind
            for job, c in pairs
            if job.expected.startswith("quarantined")
            and c not in ("lost", job.expected)
            and not c.startswith("quarantined")
        ),
        "lost": classes.count("lost"),
        "repairs": repairs,
        "seconds": time.monotonic() - started,
        "endings": Counter(
            t.quarantine or t.agent_failure or (t.verdict and t.verdict.outcome) or t.ending for t in trajectories
        ),
    }
    return counts, list(zip(jobs, trajectories, classes))


def soak_line(counts: dict) -> str:
    return (
        f"faults: {counts['injected']} injected, {counts['quarantined']} quarantined, {counts['agent_failed']} "
        f"agent-failed, {counts['misclassified']} misclassified, {counts['lost']} lost"
    )


def attribution_line(counts: dict) -> str:
    """The two directions of attribution, each by kind: both must be 0."""
    by_kind = lambda counter: ", ".join(f"{kind} {n}" for kind, n in sorted(counter.items())) or "none"  # noqa: E731
    agent, serving = counts["agent_quarantined"], counts["serving_scored"]
    return (
        f"attribution: {sum(agent.values())} agent endings quarantined ({by_kind(agent)}), "
        f"{sum(serving.values())} serving faults scored ({by_kind(serving)})"
    )


# ---------------------------------------------------------------------------------------------------- SWE mode


def bash(command: str) -> str:
    return f"```bash\n{command}\n```"


SUBMIT = bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached")
SWE_DETOURS = {  # kind -> the agent's first reply: its observation comes back, then the agent resolves the task
    "no_block": "Let me look at the repository first.",
    "two_blocks": bash("ls") + "\n" + bash("git status"),
    "command_timeout": bash("sleep 30"),
    "command_oom": bash("python3 -c 'hog = bytearray(2**30)'"),
    "fork_bomb": bash("bomb() { bomb | bomb & }; bomb"),
    "network": bash(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\" && echo ESCAPED"
    ),
    "write_outside": bash("for f in /usr/canopy-escape /etc/canopy-escape; do (echo x > $f) && echo ESCAPED $f; done"),
}
SWE_FAILURES = {  # kind -> (the agent's replies, the last one repeating; the outcome they must get)
    "wrong_fix": ([bash("for f in */core.py; do echo '# not a fix' >> $f; done"), SUBMIT], "unresolved"),
    "no_submission": ([bash("git status")], "no_submission"),
    "empty_patch": ([SUBMIT], "empty_patch"),
    "garbage_patch": (
        [bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && printf 'diff --git a/x b/x\\n@@ -1 +1 @@\\n-a\\n+b\\n'")],
        "patch_apply_failed",
    ),
}
SWE_TAMPERING = {  # kind -> (an attack of canopy.tools.swe_attacks, submitted as its patch; the outcome it must get)
    f"tamper_{name}": (next(a for a in ATTACKS if a.name == name), outcome)
    for name, outcome in {
        "conftest_outcome_hook": "unresolved (tamper restored)", "conftest_exit_zero": "unresolved (tamper restored)",
        "pytest_ini_plugin": "unresolved (tamper restored)", "entry_point_plugin": "unresolved (tamper restored)",
        "sitecustomize": "unresolved (tamper restored)", "git_hook": "unresolved (tamper restored)",
        "binary_conftest": "unresolved (tamper restored)", "forged_pycache": "unresolved (tamper restored)",
        # issue 44: caught in the test run (the canary, the log's markers), or a signature that is the patch's own
        "rewrite_spares_canary_shape": "unresolved (tamper rejected)",
        "second_start_marker": "unresolved (tamper rejected)",
        "forged_infra_signature": "unresolved (tamper rejected)",
        "late_infra_signature": "unresolved",
    }.items()
}  # fmt: skip
SWE_KINDS = (*SERVING_FAULTS, "image_unavailable", *SWE_DETOURS, *SWE_FAILURES, *SWE_TAMPERING)
SWE_REWARDS = {"resolved": 1.0, "unresolved": 0.0, "image_unavailable": 0.0, **dict.fromkeys(NO_PATCH_OUTCOMES, -0.2)}
LATENCY_OPS = {"sandbox_start": "sandbox start", "command": "command", "grading_command": "grading command",
               "grading": "grading"}  # fmt: skip


def swe_soak_jobs(count: int, fault_rate: float, seed: int, base_tasks: list[Task], image_root: Path) -> list[SoakJob]:
    """`count` episodes, a `fault_rate` share of them with a fault: the kinds in turn (a shuffled cycle, so a short
    soak still has each), phases drawn uniformly. `image_unavailable` is a missing image on an evaluation split,
    where it scores 0 (Appendix H). A tampering job carries its attack's patch, made from the task's repository in
    its image under `image_root`."""
    rng = random.Random(seed)
    kinds = rng.sample(SWE_KINDS, len(SWE_KINDS))
    jobs, faults = [], 0
    for i in range(count):
        base, kind = rng.choice(base_tasks), "clean"
        spec = dict(base.spec)
        if rng.random() < fault_rate:
            kind, faults = kinds[faults % len(kinds)], faults + 1
        if kind in SERVING_FAULTS:
            phases, reason = SERVING_FAULTS[kind]
            spec.update(inject=kind, phase=rng.choice(phases))
            expected = f"quarantined:{reason}"
        elif kind == "image_unavailable":
            spec.update(inject="image_missing", phase="start", split="eval")
            expected = "image_unavailable"
        elif kind in SWE_TAMPERING:
            attack, expected = SWE_TAMPERING[kind]
            spec.update(attack_patch=attack.patch(base.spec, Repo.of(image_root, base.spec)))
        else:
            expected = SWE_FAILURES[kind][1] if kind in SWE_FAILURES else "resolved"
        jobs.append(SoakJob(Task(f"swe{i}-{kind}", base.tier, base.scenario, spec), kind, expected))
    return jobs


class SWESoakAgent(SoakAgent):
    """The soak's scripted agent in mini-swe-agent's format: its detour or failure, else the gold patch applied
    (`git apply` of a heredoc) and submitted."""

    def action(self, job: SoakJob, turn: int) -> str:
        if job.kind in SWE_TAMPERING:
            patch = job.task.spec["attack_patch"]
            return bash(f"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat <<'CANOPY_PATCH'\n{patch}CANOPY_PATCH")
        if job.kind in SWE_FAILURES:
            replies = SWE_FAILURES[job.kind][0]
        else:
            apply = bash(f"git apply <<'CANOPY_PATCH'\n{job.task.spec['patch']}CANOPY_PATCH")
            replies = [SWE_DETOURS[job.kind], apply, SUBMIT] if job.kind in SWE_DETOURS else [apply, SUBMIT]
        return replies[min(turn, len(replies) - 1)]


def swe_observed_class(trajectory: Trajectory, tokenizer) -> str:
    """escaped | quarantined:<reason> | lost | the verdict's outcome, with its reward when Table A3 gives another."""
    if escaped(trajectory, tokenizer):
        return "escaped"
    if trajectory.quarantine is not None:
        return f"quarantined:{trajectory.quarantine}"
    if not trajectory.ending:
        return "lost"
    if trajectory.verdict is None:
        return f"agent_failure:{trajectory.agent_failure}"
    outcome, reward = trajectory.verdict.outcome, trajectory.reward("sparse")
    tamper = f" (tamper {trajectory.verdict.tamper})" if trajectory.verdict.tamper else ""
    return outcome + tamper if SWE_REWARDS.get(outcome) == reward else f"{outcome}{tamper} (reward {reward})"


def swe_soak(episodes: int, workers: int, fault_rate: float = 0.5, seed: int = 0, tasks: int = 4):
    """The SWE mode (see the module docstring) on `tasks` generated tasks; returns (counts, rows) as `soak` does,
    counts with "latency": op -> its percentiles."""
    with tempfile.TemporaryDirectory(prefix="canopy-swe-soak-") as folder:
        data = generate(Path(folder) / "tasks", tasks, seed)["train"]
        latency_dir = Path(folder) / "latency"
        kwargs = {
            "data": {"train": str(data), "eval": str(data)},
            "runtime": {"kind": "bwrap", "image_root": str(Path(folder) / "tasks" / "images"), "memory_mb": 256,
                        "pids": 64},
            "command_timeout_s": 2,
            "eval_timeout_s": 10,
            "missing_image_scores_zero": ["eval"],
            "latency_dir": str(latency_dir),
        }  # fmt: skip
        settings = PoolSettings(
            workers=workers,
            memory_mb=4096,
            request_timeout_s=30,
            health_timeout_s=2.0,
            operation_timeouts_s={"start": 15, "step": 10, "verdict": 15, "close": 10},
        )
        budget = Budget(
            max_turns=3,
            max_response_tokens=4096,
            max_prompt_tokens=8192,
            max_observation_tokens=1024,
            max_context_tokens=16384,
        )
        pool = EnvironmentPool("canopy.envs.swe_fault_injection:FaultInjectingSWEEnvironment", kwargs, settings)
        counts, rows = run_soak(
            pool,
            lambda base: swe_soak_jobs(episodes, fault_rate, seed, base, Path(folder) / "tasks" / "images"),
            SWESoakAgent,
            swe_observed_class,
            budget,
            seed,
            episodes,
        )
        counts["latency"] = latency_percentiles(latency_dir)
    counts["agent_failed"] = sum(
        c == job.expected != "resolved" and job.kind in (*SWE_FAILURES, *SWE_TAMPERING) for job, _, c in rows
    )
    return counts, rows


def latency_percentiles(folder: Path) -> dict[str, dict[str, float]]:
    """op -> {n, p50, p90, p99, max} (seconds) of the latencies the workers appended under `folder`."""
    seconds: dict[str, list[float]] = {}
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            seconds.setdefault(row["op"], []).append(row["s"])
    percentiles = {}
    for op, values in seconds.items():
        values.sort()
        at = {f"p{q}": values[min(len(values) - 1, len(values) * q // 100)] for q in (50, 90, 99)}
        percentiles[op] = {"n": len(values), **at, "max": values[-1]}
    return percentiles


def latency_lines(latency: dict[str, dict[str, float]]) -> list[str]:
    return [
        f"{LATENCY_OPS[op]}: n={p['n']} p50 {p['p50']:.3f} s, p90 {p['p90']:.3f} s, p99 {p['p99']:.3f} s, "
        f"max {p['max']:.3f} s"
        for op, p in ((op, latency[op]) for op in LATENCY_OPS if op in latency)
    ]
