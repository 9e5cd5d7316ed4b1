"""Fault soak (Appendix G): many episodes through the real worker pool and agent loop with faults of every
kind injected, each episode's ending checked against the class its fault must produce.

Serving-layer faults (`canopy.envs.fault_injection`) must be quarantined. Agent faults, sent by the scripted
agent as code (infinite loop, sleep, memory bomb, fork bomb, its own crash, a syntax error), must be scored 0
and never quarantined. Escape episodes try to write outside their scratch dir, reach the network and kill
their worker, then solve the task: they must succeed and see every attempt blocked. Clean episodes must
succeed. An episode with no ending, or in a run that raised, is lost.
"""

import random
import re
import time
from collections import Counter
from dataclasses import dataclass

from canopy.envs.base import Task
from canopy.envs.fault_injection import INFRA_FAULTS
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.rollout.agent_loop import Budget, Trajectory, run_episodes
from canopy.rollout.engine import Generation, SamplingParams
from canopy.tools.tiny_model import build_byte_tokenizer

AGENT_CODE = {
    "agent_loop": "while True:\n    pass",
    "agent_sleep": "import time\ntime.sleep(3600)",
    "agent_memory": "hog = bytearray(64 * 2**30)",
    "agent_fork": "import os\nwhile True:\n    os.fork()",
    "agent_crash": "import os\nos.abort()",
    "agent_syntax": "def broken(:\n    pass",
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
    kind: str  # clean | one of INFRA_FAULTS, AGENT_FAULTS | ESCAPE
    expected: str  # quarantined | agent_scored_0 | success


def soak_jobs(count: int, fault_rate: float, seed: int, base_tasks: list[Task]) -> list[SoakJob]:
    """`count` episodes, a `fault_rate` share of them with a fault; kinds and phases drawn uniformly."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        base = rng.choice(base_tasks)
        kind = rng.choice(INFRA_FAULTS + AGENT_FAULTS + (ESCAPE,)) if rng.random() < fault_rate else "clean"
        spec = dict(base.spec)
        if kind in INFRA_FAULTS:
            spec.update(
                inject=kind,
                phase=rng.choice(("step", "verdict") if kind == "corruption" else ("start", "step", "verdict")),
            )
        expected = "quarantined" if kind in INFRA_FAULTS else "agent_scored_0" if kind in AGENT_FAULTS else "success"
        jobs.append(SoakJob(Task(f"soak{i}-{kind}", base.tier, base.scenario, spec), kind, expected))
    return jobs


class SoakAgent:
    """A scripted policy behind the engine contract: it reads the episode tag in the prompt and answers with
    that episode's script (turn 1: its fault, escape attempt or an ordinary step; turn 2: the answer)."""

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

    def generate(self, prompts, max_new_tokens, sampling) -> list[Generation]:
        out = []
        for prompt, limit in zip(prompts, max_new_tokens):
            text = self.tokenizer.decode(prompt)
            job = self.jobs[EPISODE_TAG.search(text).group(1)]
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.tokenizer.encode(self.action(job, turn), add_special_tokens=False)[: limit - 1] + [self.im_end]
            out.append(Generation(ids, [0.0] * len(ids), "stop", self.weight_version))
        return out


def observed_class(trajectory: Trajectory, tokenizer) -> str:
    observations = [token for token, mask in zip(trajectory.token_ids, trajectory.action_mask) if not mask]
    if "ESCAPED" in tokenizer.decode(observations[trajectory.prompt_length :]):
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
    tokenizer = build_byte_tokenizer()
    budget = Budget(
        max_turns=3,
        max_response_tokens=4096,
        max_prompt_tokens=1024,
        max_observation_tokens=512,
        max_context_tokens=8192,
    )
    started = time.monotonic()
    pool = EnvironmentPool("canopy.envs.fault_injection:FaultInjectingEnvironment", {"sandbox": sandbox}, settings)
    jobs, trajectories = [], []
    try:
        jobs = soak_jobs(episodes, fault_rate, seed, pool.tasks("train"))
        trajectories, _ = run_episodes(
            SoakAgent(tokenizer, jobs),
            pool,
            tokenizer,
            [(job.task, 0) for job in jobs],
            budget,
            SamplingParams(),
            seed=seed,
            description="fault soak",
        )
    except Exception as error:  # a run that raised lost every episode in it
        print(f"soak aborted: {error!r}")
        trajectories = []
    finally:
        repairs = pool.repairs
        pool.close()
    classes = [observed_class(t, tokenizer) for t in trajectories]
    classes += ["lost"] * (episodes - len(classes))
    counts = {
        "injected": sum(job.kind != "clean" for job in jobs),
        "quarantined": classes.count("quarantined"),
        "agent_failed": sum(c == "agent_scored_0" and job.kind in AGENT_FAULTS for job, c in zip(jobs, classes)),
        "misclassified": sum(c not in (job.expected, "lost") for job, c in zip(jobs, classes)),
        "lost": classes.count("lost"),
        "repairs": repairs,
        "seconds": time.monotonic() - started,
        "endings": Counter(t.quarantine or t.agent_failure or t.ending for t in trajectories),
    }
    return counts, list(zip(jobs, trajectories, classes))


def soak_line(counts: dict) -> str:
    return (
        f"faults: {counts['injected']} injected, {counts['quarantined']} quarantined, {counts['agent_failed']} "
        f"agent-failed, {counts['misclassified']} misclassified, {counts['lost']} lost"
    )
