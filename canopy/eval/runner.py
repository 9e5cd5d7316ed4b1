"""Sampling k evaluation runs per task and turning them into Table 3 rows; shared by evaluate.py, the pilot
and the budget-transfer callback."""

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from canopy.envs.base import Task
from canopy.errors import require
from canopy.eval.metrics import by_scenario, summarize
from canopy.modules.checkpoint import checkpoint_kind
from canopy.modules.policy import iter_hf_weights, load_policy
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.faults import check_systemic_faults
from canopy.rollout.trajectory import invalid_action_fracs


def with_budget(cfg: DictConfig, budget_cfg: DictConfig) -> DictConfig:
    """A copy of the run config whose budget and sampling are `budget_cfg`'s."""
    out = OmegaConf.merge(cfg)
    out.budget, out.sampling = budget_cfg.budget, budget_cfg.sampling
    return out


@dataclass
class Sampled:
    """k evaluation runs per task: {task id: k sparse outcomes}, the quarantined count, the count of each named
    outcome (`Verdict.outcome`, e.g. SWE-bench's resolved / unresolved / image_unavailable), and per tier the scored
    episodes' invalid actions and the actions the environment answered (format health)."""

    runs: dict[str, list[float]]
    quarantined: int
    outcomes: Counter
    actions_by_tier: dict[int, list[int]]  # tier -> [invalid actions, actions answered]


def sample_runs(
    engine,
    env,
    tokenizer,
    tasks: list[Task],
    k: int,
    budget,
    sampling,
    seed: int = 0,
    description: str = "evaluating",
    max_quarantine_fraction: float = 0.5,
    trajectory_log=None,
    log_as: tuple[str, int] = ("eval", 0),
) -> Sampled:
    """k episodes per task at the engine's current weights. Quarantined episodes carry no outcome (Appendix G); a
    task keeps its other runs. A systematic serving fault stops the evaluation (`check_systemic_faults`) rather
    than reporting a score over the survivors. With a `trajectory_log`, the episodes go to it as (stream, step)
    `log_as`, each task's k runs one group."""
    jobs = [(task, i) for task in tasks for i in range(k)]
    trajectories, _ = run_episodes(engine, env, tokenizer, jobs, budget, sampling, seed=seed, description=description)
    if trajectory_log is not None:
        trajectory_log.log_step(*log_as, [trajectories[i : i + k] for i in range(0, len(trajectories), k)])
    check_systemic_faults(trajectories, max_quarantine_fraction, env.max_concurrent_episodes, description)
    runs: dict[str, list[float]] = defaultdict(list)
    actions: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for t in trajectories:
        if t.quarantine is None:
            runs[t.task.task_id].append(float(t.verdict is not None and t.verdict.success))
            actions[t.task.tier][0] += len(t.invalid_turns)
            actions[t.task.tier][1] += t.actions
    outcomes = Counter(t.verdict.outcome for t in trajectories if t.verdict is not None and t.verdict.outcome)
    return Sampled(dict(runs), sum(t.quarantine is not None for t in trajectories), outcomes, dict(actions))


def evaluation(tasks: list[Task], sampled: Sampled, **meta) -> dict:
    """The JSON record of one evaluation: metadata, per-tier metrics (see `metrics.summarize`), mean@k / best@k
    per scenario (SWE-bench: per repository), the named outcomes' counts and the share of invalid actions (format
    health), over all and by tier."""
    record = {**meta, "quarantined": sampled.quarantined, "metrics": summarize(tasks, sampled.runs)}
    record["by_scenario"] = by_scenario(tasks, sampled.runs)
    record["invalid_action_frac"] = invalid_action_fracs(sampled.actions_by_tier)  # format health
    if sampled.outcomes:
        record["outcomes"] = dict(sampled.outcomes.most_common())
    return record


def check_checkpoint(checkpoint: str | Path) -> str:
    """The kind (`checkpoint_kind`) of evaluate.py's `checkpoint`: `hf` or `ckpt`, else a ConfigError naming what
    to pass."""
    problems = {
        "missing": "does not exist",
        "other": "is neither an HF checkpoint directory (config.json + *.safetensors) nor a Lightning .ckpt",
        "sharded": "is a sharded (multi-process) training checkpoint, which evaluate.py does not load",
        "unfinished": "is a sharded training checkpoint whose save did not finish",
    }
    kind = checkpoint_kind(checkpoint)
    require(
        kind in ("hf", "ckpt"),
        f"checkpoint '{checkpoint}' {problems.get(kind)}: pass an HF checkpoint directory (e.g. <run dir>/final_hf) "
        "or a single-file .ckpt written by checkpoint.every_n_steps",
    )
    return kind


def checkpoint_weights(checkpoint: str | Path, base_path: str):
    """How to get a checkpoint's policy into an engine: (HF directory to load, HF weights to push or None).

    An HF directory loads as is; a Lightning `.ckpt` is the base architecture plus its policy state."""
    if check_checkpoint(checkpoint) == "hf":
        return str(checkpoint), None
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]  # a Lightning checkpoint
    policy, adapter = load_policy(base_path)
    policy.load_state_dict({k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")})
    return base_path, iter_hf_weights(policy, adapter)


def format_table3(results: list[dict]) -> str:
    """Markdown shaped like Table 3: one row per (policy, budget, tier), TGC and SGC as m@k / b@k in percent."""
    k = results[0]["k"]
    head = f"| Policy | Budget | Split | Tasks | TGC m@{k} | TGC b@{k} | SGC m@{k} | SGC b@{k} |"
    rows = [head, "|---|---|---|---|---|---|---|---|"]
    pct = lambda row, key: f"{100 * row[key]:.1f}" if key in row else "-"  # noqa: E731
    for r in results:
        for tier, row in r["metrics"].items():
            rows.append(
                f"| {r['policy']} | {r['budget']} | {r['split']} | {tier} ({row['tasks']}) | "
                f"{pct(row, 'tgc_mean')} | {pct(row, 'tgc_best')} | {pct(row, 'sgc_mean')} | {pct(row, 'sgc_best')} |"
            )
    return "\n".join(rows)


def format_scenarios(result: dict) -> str:
    """Markdown of one evaluation's mean@k / best@k per scenario (SWE-bench: per repository), and its outcomes."""
    k = result["k"]
    rows = [f"| {result['policy']}: scenario | tasks | m@{k} | b@{k} |", "|---|---|---|---|"]
    for scenario, row in result.get("by_scenario", {}).items():
        rows.append(f"| {scenario} | {row['tasks']} | {100 * row['tgc_mean']:.1f} | {100 * row['tgc_best']:.1f} |")
    if result.get("outcomes"):
        rows.append("\noutcomes: " + ", ".join(f"{name} {count}" for name, count in result["outcomes"].items()))
    if result.get("invalid_action_frac"):
        shares = result["invalid_action_frac"].items()
        rows.append("\ninvalid actions: " + ", ".join(f"{name} {100 * share:.1f}%" for name, share in shares))
    return "\n".join(rows)


def write_results(out_dir: Path, name: str, results: list[dict]) -> tuple[Path, Path]:
    """`<name>.json` (the records) and `<name>.md` (the Table 3 view, then each result's per-scenario view)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(results, indent=2))
    md_path.write_text("\n\n".join([format_table3(results)] + [format_scenarios(r) for r in results]) + "\n")
    return json_path, md_path


def budget_label(budget: DictConfig) -> str:
    """e.g. `enlarged (100t/61440)`: the budget's name, turns and response tokens."""
    return f"{budget.name} ({budget.max_turns}t/{budget.max_response_tokens})"
