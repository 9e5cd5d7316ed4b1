"""The local engine: sessions (each episode's cache kept between its turns) against the engine before them, on the
embedded default's rollouts; and its decode loop against transformers' own `generate`.

    python bench/local_engine.py [--steps 3] [--baseline-rev a5bf65e] [--rows 128] [--new-tokens 16] [--repeats 5]

Rollouts: the embedded default's first `--steps` rollout batches (8 tasks x 16 episodes, its checkpoint, seeds and
budget) by three engines, interleaved step by step, each seeded alike before each step:
  baseline  the engine at `--baseline-rev` (before sessions), loaded from git;
  replay    this engine with `session_tokens=0`: every turn prefills the episode's whole history (a group's shared
            first prompt still once);
  sessions  this engine as configured.
Printed per engine: generation seconds per step and the ratio to the baseline's, the prefill tokens per step (real
tokens, and positions computed with padding) and decode tokens per step, all counted by a forward hook on the model;
then for replay and sessions against the baseline, the episodes whose tokens are identical and the largest logprob
difference on them.
Decode loop: `--rows` rows of the same prompts, `--new-tokens` tokens each with no stop token, sampled by this engine
and by `model.generate(do_sample=True)` on the same model; median seconds over interleaved repeats and their ratio.
"""

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canopy.build import build_env, build_tokenizer, ensure_model  # noqa: E402
from canopy.config import validate  # noqa: E402
from canopy.rollout.agent_loop import run_episodes  # noqa: E402
from canopy.rollout.budget import Budget  # noqa: E402
from canopy.rollout.engine import SamplingParams  # noqa: E402
from canopy.rollout.local import LocalEngine  # noqa: E402
from canopy.rollout.settings import LocalEngineSettings  # noqa: E402
from canopy.tools.memory_plan import compose_config  # noqa: E402


class Baseline:
    """The engine at a git revision, under today's contract (it keeps nothing between turns)."""

    concurrent = False  # a batch at a time, as `run_episodes` reads it

    def __init__(self, rev: str, *args):
        listed = subprocess.check_output(["git", "ls-tree", "--name-only", rev, "canopy/rollout/"], cwd=ROOT, text=True)
        path = "canopy/rollout/local.py" if "canopy/rollout/local.py" in listed.split() else "canopy/rollout/engine.py"
        source = subprocess.check_output(["git", "show", f"{rev}:{path}"], cwd=ROOT, text=True)
        module = types.ModuleType(f"engine_at_{rev}")
        exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
        self.engine = module.LocalEngine(*args)
        self.model, self.generator, self.weight_version = self.engine.model, self.engine.generator, 0

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        return self.engine.generate(prompts, max_new_tokens, sampling)

    def release(self, keys):
        pass


class TokenCount:
    """Counts what each forward of the model computes: prefill (several positions per row) and decode (one)."""

    def __init__(self, model):
        self.prefill, self.prefill_positions, self.decode = 0, 0, 0
        model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        if ids.shape[1] == 1:
            self.decode += ids.shape[0]
        else:
            self.prefill += int(mask[:, -ids.shape[1] :].sum())
            self.prefill_positions += ids.numel()


def rollouts(args) -> None:
    cfg = compose_config([])
    validate(cfg)
    model_path = ensure_model(cfg)
    tokenizer, env = build_tokenizer(cfg, model_path), build_env(cfg)
    budget, sampling = Budget.of(cfg.budget), SamplingParams.of(cfg.sampling)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    common = (model_path, stops, tokenizer.pad_token_id, cfg.seed)
    engines = {
        "baseline": Baseline(args.baseline_rev, *common),
        "replay": LocalEngine(*common, settings=LocalEngineSettings(session_tokens=0)),
        "sessions": LocalEngine(*common, settings=OmegaConf.to_object(cfg.engine.local)),
    }
    counts = {name: TokenCount(engine.model) for name, engine in engines.items()}
    seconds = {name: [] for name in engines}
    outputs = {name: [] for name in engines}
    tasks = env.tasks("train")
    per_step = cfg.data.tasks_per_step
    for step in range(args.steps):
        chosen = [tasks[(step * per_step + i) % len(tasks)] for i in range(per_step)]
        jobs = [(task, i) for task in chosen for i in range(cfg.algorithm.group_size)]
        names = list(engines)[step % 3 :] + list(engines)[: step % 3]  # interleaved: drift hits all alike
        for name in names:
            engines[name].generator.manual_seed(cfg.seed + step)
            trajectories, timings = run_episodes(
                engines[name], env, tokenizer, jobs, budget, sampling, seed=cfg.seed + 1_000_003 * step
            )
            seconds[name].append(timings["generation"])
            outputs[name] += trajectories
    print(f"rollouts: {args.steps} steps x {len(jobs)} episodes, embedded default ({model_path})")
    print(f"{'engine':<10} {'gen s/step':>10} {'vs base':>8} {'prefill':>9} {'(padded)':>9} {'decode':>8}")
    base = statistics.median(seconds["baseline"])
    for name in engines:
        median, c = statistics.median(seconds[name]), counts[name]
        print(
            f"{name:<10} {median:>10.3f} {base / median:>7.2f}x {c.prefill / args.steps:>9.0f} "
            f"{c.prefill_positions / args.steps:>9.0f} {c.decode / args.steps:>8.0f}"
        )
    for name in ("replay", "sessions"):
        same = [(a, b) for a, b in zip(outputs["baseline"], outputs[name]) if a.token_ids == b.token_ids]
        gap = max((max(abs(x - y) for x, y in zip(a.engine_logprobs, b.engine_logprobs)) for a, b in same), default=0)
        identical = f"{len(same)}/{len(outputs[name])} episodes token-identical"
        print(f"{name} vs baseline: {identical}, max |dlogprob| {gap:.1e}")
    sampled = sum(sum(t.action_mask) for t in outputs["sessions"]) / args.steps
    print(f"sampled tokens per step: {sampled:.0f}")


def decode_loop(args) -> None:
    cfg = compose_config([])
    model_path = ensure_model(cfg)
    tokenizer = build_tokenizer(cfg, model_path)
    engine = LocalEngine(
        model_path, [], tokenizer.pad_token_id, cfg.seed, settings=LocalEngineSettings(session_tokens=0)
    )
    prompt = tokenizer.encode("task : vault 1 . status : guest", add_special_tokens=False)
    prompts = [prompt[: 4 + i % (len(prompt) - 3)] for i in range(args.rows)]  # lengths vary: left padding
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (ids != tokenizer.pad_token_id).long()
    sampling = SamplingParams(temperature=0.9, top_p=1.0, top_k=-1)

    def ours():
        engine.generate(prompts, [args.new_tokens] * args.rows, sampling)

    def theirs():
        engine.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=0.9,
            top_k=None,
            top_p=None,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )

    timings = {"canopy": [], "transformers": []}
    for repeat in range(args.repeats + 1):
        for name, run in (("canopy", ours), ("transformers", theirs))[:: 1 if repeat % 2 else -1]:
            began = time.perf_counter()
            run()
            if repeat:  # the first round warms both up
                timings[name].append(time.perf_counter() - began)
    ours_s, theirs_s = statistics.median(timings["canopy"]), statistics.median(timings["transformers"])
    print(f"decode loop: {args.rows} rows x {args.new_tokens} tokens, median of {args.repeats}")
    print(f"canopy {ours_s:.3f} s, transformers generate {theirs_s:.3f} s: canopy is {theirs_s / ours_s:.2f}x as fast")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--baseline-rev", default="a5bf65e")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part", choices=["all", "rollouts", "decode"], default="all")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.part in ("all", "rollouts"):
        rollouts(args)
    if args.part in ("all", "decode"):
        decode_loop(args)


if __name__ == "__main__":
    main()
