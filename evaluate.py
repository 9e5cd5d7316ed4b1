"""Evaluate a policy (Section 4.1, Table 3, Fig. 5) or run the pilot (Section 3.2, Eq. 5).

python evaluate.py checkpoint=outputs/.../final_hf budget=embedded_enlarged split=dev k=4
python evaluate.py experiment=appworld_canopy checkpoint=... budget=enlarged split=test_normal k=4
python evaluate.py pilot=true tau=0.9
"""

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from transformers.utils.logging import disable_progress_bar

from canopy.build import (
    build_engine,
    build_env,
    build_tokenizer,
    build_trajectory_log,
    ensure_model,
)
from canopy.config import check_command_line, check_context, mean_group_size, validate, validate_eval
from canopy.errors import ConfigError, RunStopped
from canopy.eval.from_run import inherited_overrides
from canopy.eval.pilot import format_pilot, pilot_report
from canopy.eval.runner import budget_label, checkpoint_weights, evaluation, sample_runs, write_results
from canopy.reports.plots import plot_budget_transfer, plot_coverage
from canopy.reports.viewer import build_viewer
from canopy.rollout.budget import Budget
from canopy.rollout.engine import SamplingParams


def train_view(cfg: DictConfig) -> DictConfig:
    """The config as `validate` checks it: `checkpoint=<path>` here replaces train.yaml's checkpoint section."""
    view = cfg.copy()  # typed as composed: `validate` reads each section's schema
    view.checkpoint = {"every_n_steps": 0, "resume": None}
    return view


@hydra.main(config_path="conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    disable_progress_bar()  # transformers' loading and saving bars: the console shows the evaluation's own
    try:
        validate(train_view(cfg))
        validate_eval(cfg)
        env = build_env(cfg, log_dir=out_dir / "env_logs")  # checks the environment's own keys; starts nothing yet
        base_path = ensure_model(cfg)
        model_path, weights = checkpoint_weights(cfg.checkpoint, base_path) if cfg.checkpoint else (base_path, None)
        check_context(cfg, model_path, training=False)  # the budget fits the model's positions (or YaRN covers them)
        tokenizer = build_tokenizer(cfg, model_path)
        engine = build_engine(cfg, model_path, tokenizer)  # applies budget.rope_scaling (YaRN) when set
        tasks = env.tasks(cfg.data.split if cfg.pilot else cfg.split)
        trajectory_log = build_trajectory_log(cfg, tokenizer, model_path, out_dir / "trajectories")
    except RunStopped as error:
        sys.exit(f"{error.label}: {error}")
    except ValueError as error:
        sys.exit(f"config error: {error}")
    if weights is not None:
        engine.update_weights(weights, version=0)
    try:
        run(cfg, env, engine, tokenizer, tasks, out_dir, trajectory_log)
    except RunStopped as error:
        sys.exit(f"{error.label}: {error}")
    finally:
        if trajectory_log is not None:
            trajectory_log.close()
        env.close()
    if trajectory_log is not None:
        print(f"rollout viewer: {build_viewer(out_dir)}")


def run(cfg: DictConfig, env, engine, tokenizer, tasks, out_dir: Path, trajectory_log=None) -> None:
    """The pilot (per-tier base success and Eq. 5's group size) or the evaluation (Table 3 rows, Fig. 5)."""
    budget, sampling = Budget.of(cfg.budget), SamplingParams.of(cfg.sampling)
    used = {  # printed now and recorded with the results
        "env": cfg.env.name,
        "model_family": cfg.model.family,
        "budget_config": OmegaConf.to_container(cfg.budget, resolve=True),
        "sampling": OmegaConf.to_container(cfg.sampling, resolve=True),
    }
    print(
        f"{'pilot' if cfg.pilot else 'evaluation'} on env {used['env']} ({cfg.model.family}), budget "
        f"{budget_label(cfg.budget)} with a {cfg.budget.max_context_tokens:,}-token context"
        + (f" and rope_scaling {used['budget_config']['rope_scaling']}" if cfg.budget.rope_scaling else "")
        + ", sampling "
        + " ".join(f"{k}={v}" for k, v in used["sampling"].items())
    )
    if cfg.pilot:
        runs = sample_runs(
            engine,
            env,
            tokenizer,
            tasks,
            cfg.pilot_samples,
            budget,
            sampling,
            cfg.seed,
            "pilot",
            cfg.env.max_quarantine_fraction,
            trajectory_log,
            ("pilot", 0),
        ).runs
        rates = {}
        for tier in sorted({t.tier for t in tasks}):
            outcomes = [o for t in tasks if t.tier == tier for o in runs.get(t.task_id, [])]
            rates[f"tier{tier}"] = (sum(outcomes) / max(1, len(outcomes)), len(outcomes))
        groups = list(cfg.pilot_group_sizes)
        report = {**pilot_report(rates, cfg.tau, groups), **used}
        (out_dir / "pilot.json").write_text(json.dumps(report, indent=2))
        plot_coverage(out_dir / "fig2_coverage.png", mean_group_size(cfg), {t: p for t, (p, _) in rates.items()})
        print(
            f"\nPilot on {cfg.data.split} ({cfg.pilot_samples} rollouts per task, {budget_label(cfg.budget)}):\n"
            f"{format_pilot(report, groups)}\n\nwritten: {out_dir}/pilot.json, fig2_coverage.png"
        )
        return
    policy = cfg.policy or (Path(cfg.checkpoint).name if cfg.checkpoint else "base")
    sampled = sample_runs(
        engine,
        env,
        tokenizer,
        tasks,
        cfg.k,
        budget,
        sampling,
        cfg.seed,
        f"eval {policy}",
        cfg.env.max_quarantine_fraction,
        trajectory_log,
        (f"eval_{cfg.budget.name}", 0),
    )
    result = evaluation(
        tasks,
        sampled,
        policy=policy,
        checkpoint=cfg.checkpoint,
        budget=budget_label(cfg.budget),
        split=cfg.split,
        k=cfg.k,
        **used,
    )
    results = ([json.loads(Path(cfg.transfer_from).read_text())[0]] if cfg.transfer_from else []) + [result]
    json_path, md_path = write_results(out_dir, "eval", [result])
    figure = plot_budget_transfer(results, out_dir / "fig5_budget_transfer.png")
    print(f"\n{md_path.read_text()}\nwritten: {json_path}, {md_path.name}, {figure.name}")


if __name__ == "__main__":
    run_dir, inherited = inherited_overrides(sys.argv[1:])  # the trained run's experiment, environment and model
    sys.argv[1:] = inherited + sys.argv[1:]  # before the command line's own, which win
    try:
        check_command_line(sys.argv[1:], "evaluate")  # a typo'd key or option: one line, before Hydra's report
    except ConfigError as error:
        sys.exit(f"config error: {error}")
    if run_dir is not None:
        print(f"from the run {run_dir}: {' '.join(inherited) or '(its defaults)'}")
    main()
