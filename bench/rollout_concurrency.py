"""One rollout step against fake SGLang servers with long-tailed request latencies: the per-episode loop against the
old turn-synchronous (barrier) loop, and against the ideal.

    python bench/rollout_concurrency.py [--episodes 64] [--turns 20] [--servers 4] [--decode-tps 200]

Each request's latency is its generated-token count over a set decode speed, the count drawn from a lognormal that
is fixed by the episode and the turn (the same in both loops); environment steps take `--step-ms`. The ideal is
the longest episode's own critical path (its requests and steps one after another): no loop can finish sooner.
Printed: both wall times, their ratio, each as a multiple of the ideal, and the prefix-cache locality (the fraction
of turns routed to the server of their episode's first turn). Targets (issue 15): the per-episode loop within 1.2x
of the ideal, >= 2x faster than the barrier loop at 64 episodes x 20 turns, locality 1.0.
"""

import argparse
import random
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fake_sglang import FakeSGLang  # noqa: E402
from scripted import FakeEngine  # noqa: E402

from canopy.envs.base import StepResult, Task, Verdict  # noqa: E402
from canopy.rollout.agent_loop import run_episodes  # noqa: E402
from canopy.rollout.budget import Budget  # noqa: E402
from canopy.rollout.engine import SamplingParams  # noqa: E402
from canopy.rollout.sglang import SGLangEngine, SGLangSettings  # noqa: E402
from canopy.tiny_model import build_byte_tokenizer, build_tiny_checkpoint  # noqa: E402


class Episode:
    def __init__(self, task: Task, step_s: float):
        self.task, self.turn, self.step_s = task, 0, step_s

    def messages(self):
        return [{"role": "user", "content": f"episode {self.task.task_id} "}]

    def step(self, action_text):
        time.sleep(self.step_s)
        self.turn += 1
        return StepResult(f"turn {self.turn}", done=self.turn == self.task.spec["turns"])

    def verdict(self):
        return Verdict(1, 1)

    def close(self):
        pass


class Environment:
    """Episodes of a fixed number of turns. `max_concurrent_episodes` makes the loop run each episode's steps in
    threads, as with a pool of environment workers."""

    def __init__(self, step_s: float, concurrent_episodes: int | None):
        self.step_s, self.max_concurrent_episodes = step_s, concurrent_episodes

    def start(self, task, seed):
        return Episode(task, self.step_s)

    def close(self):
        pass


class BarrierEngine(FakeEngine):
    """The old loop: the engine takes a batch at a time, so every live episode's turn waits for the slowest one."""

    concurrent = False

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        return self.engine.generate(prompts, max_new_tokens, sampling, keys)

    def release(self, keys):
        self.engine.release(keys)


def latency(episode: str, turn: int, seed: int, decode_tps: float) -> float:
    """Seconds for this episode's turn: lognormal tokens (median 64, long tail) over the decode speed."""
    rng = random.Random(zlib.crc32(f"{seed}:{episode}:{turn}".encode()))
    return min(4096, rng.lognormvariate(4.16, 1.0)) / decode_tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--decode-tps", type=float, default=200.0, help="decode tokens/s of one request")
    parser.add_argument("--step-ms", type=float, default=5.0, help="one environment step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = build_byte_tokenizer()

    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")

    def delay(body):  # cheap: the fake servers share this process (and its GIL) with the loop under test
        ids = body["input_ids"]
        episode = tokenizer.decode(ids[:24]).split("episode ")[1].split(" ")[0]
        return latency(episode, (ids.count(im_start) - 2) // 2, args.seed, args.decode_tps)

    servers = [FakeSGLang(delay=delay) for _ in range(args.servers)]
    with tempfile.TemporaryDirectory() as folder:
        model = build_tiny_checkpoint(Path(folder) / "tiny", seed=0)
        settings = SGLangSettings(urls=[s.url for s in servers], sync_dir=str(Path(folder) / "sync"), concurrency=256)
        engine = SGLangEngine(model, [0, 2], settings, retry_backoff_s=0.0)
        budget = Budget(max_turns=args.turns, max_response_tokens=1 << 16, max_prompt_tokens=256,
                        max_observation_tokens=32, max_context_tokens=1 << 17)  # fmt: skip
        jobs = [(Task(f"e{i}", 1, "s", {"turns": args.turns}), 0) for i in range(args.episodes)]
        step_s = args.step_ms / 1000
        ideal = max(
            sum(latency(f"e{i}", t, args.seed, args.decode_tps) + step_s for t in range(args.turns))
            for i in range(args.episodes)
        )
        runs = {}
        for name, eng, env in (
            ("barrier loop (old)", BarrierEngine(engine), Environment(step_s, None)),
            ("per-episode loop", engine, Environment(step_s, args.episodes)),
        ):
            started = time.perf_counter()
            trajectories, _ = run_episodes(
                eng,
                env,
                tokenizer,
                jobs,
                budget,
                SamplingParams(temperature=1.0, top_p=1.0, top_k=-1),
                description=name,
            )
            runs[name] = time.perf_counter() - started
            assert all(t.num_turns == args.turns and t.verdict is not None for t in trajectories), name
        engine.close()
    for server in servers:
        server.stop()
    old, new = runs["barrier loop (old)"], runs["per-episode loop"]
    print(f"{args.episodes} episodes x {args.turns} turns, {args.servers} fake servers, lognormal tokens at "
          f"{args.decode_tps:.0f} tok/s, {args.step_ms:.0f} ms steps")  # fmt: skip
    print(f"ideal (longest episode's critical path)  {ideal:7.2f} s   1.00x")
    print(f"per-episode loop                          {new:7.2f} s   {new / ideal:.2f}x of ideal")
    print(f"barrier loop (old)                        {old:7.2f} s   {old / ideal:.2f}x of ideal")
    print(f"per-episode vs barrier: {old / new:.2f}x faster")
    turns, first = engine.router.counts["turns"], engine.router.counts["on_first_server"]
    print(f"prefix-cache locality: {first / turns:.3f} of turns on their episode's first server ({turns} turns)")


if __name__ == "__main__":
    main()
