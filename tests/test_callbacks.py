"""Callbacks on hand-built steps: audit, entropy monitor, quarantine stats, coverage numbers, budget transfer."""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from canopy.callbacks import (
    BudgetTransferEval,
    CoverageLogger,
    EntropyMonitor,
    FormatDriftError,
    FormatMonitor,
    OnPolicyAudit,
    QuarantineStats,
    RolloutViewer,
    StepProgress,
    build_callbacks,
)
from canopy.coverage import signal_coverage
from canopy.envs.base import Task
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.errors import ConfigError
from canopy.mismatch import OffPolicyError
from canopy.reports.tb_scalars import read_scalars
from canopy.rollout.local import LocalEngine
from canopy.step import StepStats, same_task_groups
from canopy.trajectories import TrajectoryLog, read_step
from tests.helpers import config, logged_episodes, trajectory

ROOT = Path(__file__).resolve().parents[1]


class Module(SimpleNamespace):
    def log_dict(self, metrics, **kwargs):
        self.logged.update(metrics)


def step(metrics=None, batch_metrics=None, minibatches=1, global_step=5, stats=None):
    trainer = SimpleNamespace(global_step=global_step, callback_metrics=metrics or {}, is_global_zero=True)
    module = Module(hparams=SimpleNamespace(minibatches_per_step=minibatches), logged={}, weight_version=global_step)
    return trainer, module, SimpleNamespace(metrics=batch_metrics or {}, stats=stats)


BOUNDS = {
    "bfloat16": {"parity": 0.03, "warn": 0.05, "stop": 0.15},
    "float32": {"parity": 1e-3, "warn": 1e-4, "stop": 1e-3},
}


def audited(audit, gaps, dtype="bfloat16"):
    """Run `gaps` (one engine-trainer gap per update) through the audit as a run would; returns the updates it let
    through."""
    module = SimpleNamespace(engine=SimpleNamespace(dtype=dtype), update_stats={}, weight_version=0)
    trainer = SimpleNamespace(global_step=0)
    audit.setup(trainer, module, "fit")
    audit.on_train_start(trainer, module)
    for gap in gaps:
        module.update_stats = {"mismatch/logprob_gap": gap}
        audit.on_before_optimizer_step(trainer, module, None)
        trainer.global_step = module.weight_version = trainer.global_step + 1
    return trainer.global_step


def test_on_policy_audit_bounds_parity_then_every_update():
    assert audited(OnPolicyAudit(BOUNDS), [0.02, 0.04, 0.049]) == 3  # bf16 noise: parity, then below warn
    with pytest.raises(OffPolicyError, match=r"update 0 .*differ from the trainer's by 0.04 .*parity bound 0.03 for"):
        audited(OnPolicyAudit(BOUNDS), [0.04])  # the same gap passes later, never before any update
    with pytest.raises(OffPolicyError, match=r"update 2 \(rollout step 2\): engine-trainer logprob gap 0.2 .* > stop"):
        audited(OnPolicyAudit(BOUNDS), [0.01, 0.02, 0.2, 0.01])  # the stale-weights signature of design/scale.md
    with pytest.warns(RuntimeWarning, match=r"gap 0.06 per action token > warn bound 0.05 for bfloat16"):
        assert audited(OnPolicyAudit(BOUNDS), [0.01, 0.06]) == 2
    with pytest.warns(RuntimeWarning, match="stop bound 0.001 for float32"):
        assert audited(OnPolicyAudit(BOUNDS, strict=False), [0.0, 0.5], dtype="float32") == 2
    restarted = OnPolicyAudit(BOUNDS)
    assert audited(restarted, [0.01, 0.03]) == 2
    with pytest.raises(OffPolicyError, match="parity"):  # a resumed run is audited for parity again
        audited(restarted, [0.1])


def test_on_policy_audit_needs_bounds_for_the_engines_dtype():
    with pytest.raises(
        ConfigError, match=r"no bounds for an engine computing in float16: add engine.gap_bounds.float16"
    ):
        audited(OnPolicyAudit(BOUNDS), [0.0], dtype="float16")
    with pytest.raises(ConfigError, match=r"engine.gap_bounds.float32=.*0 < warn <= stop"):
        OnPolicyAudit({"float32": {"parity": 1e-3, "warn": 1e-2, "stop": 1e-3}})


def test_entropy_monitor_warns_on_collapse_and_fast_fall():
    monitor = EntropyMonitor(min_entropy=0.05, window=3, max_relative_drop=0.5)
    assert [monitor.check(s, e) for s, e in enumerate([0.4, 0.38, 0.39, 0.37, 0.36])] == [None] * 5  # healthy
    assert "fell" in monitor.check(5, 0.15)  # 0.37 -> 0.15 within 3 steps: -59%
    assert monitor.check(6, 0.14) is None  # one warning per window
    collapse = EntropyMonitor(min_entropy=0.05)
    trainer, module, batch = step({"actor/entropy": 0.036})  # the no-KL run's step-90 entropy (Table A2)
    with pytest.warns(RuntimeWarning, match="entropy collapsing: entropy 0.0360 < min_entropy 0.05"):
        collapse.on_train_batch_end(trainer, module, None, batch, 0)


def test_format_monitor_judges_the_mean_over_a_full_window():
    monitor = FormatMonitor(warn_above=0.3, window=3)
    assert [monitor.check(s, share, None) for s, share in enumerate([0.9, 0.9])] == [None, None]  # window not full
    assert monitor.check(2, 0.0, None) == ("warn", pytest.approx(0.6))  # (0.9 + 0.9 + 0) / 3
    assert monitor.check(3, 0.9, None) is None  # one warning per window
    assert monitor.check(4, None, None) is None and len(monitor.shares) == 3  # a step with no action answered
    healthy = FormatMonitor(warn_above=0.3, window=3)
    assert [healthy.check(s, share, None) for s, share in enumerate([0.1, 0.2, 0.5, 0.1])] == [None] * 4  # 0.27
    stopping = FormatMonitor(warn_above=0.3, window=2, stop_above=0.6)
    assert [stopping.check(s, share, None) for s, share in enumerate([0.5, 0.6, 0.7])] == [
        None,
        ("warn", pytest.approx(0.55)),
        ("stop", pytest.approx(0.65)),
    ]
    assert FormatMonitor(warn_above=0.3, window=2).check(1, 0.99, None) is None  # stop_above null: never stops


def format_step(tmp_path, shares, viewer=True):
    """Run `shares` (one step's invalid-action share each; step 1's episode 3 of vault0_s1_t2 is invalid) through the
    monitor's hook as a run would, in a run folder `tmp_path`; returns the monitor."""
    monitor = FormatMonitor(warn_above=0.3, window=2, stop_above=0.6)
    trainer, module, batch = step()
    trainer.default_root_dir = str(tmp_path)
    trainer.datamodule = SimpleNamespace(trajectory_log=object())
    trainer.callbacks = [monitor] + ([RolloutViewer()] if viewer else [])
    for s, share in enumerate(shares):
        module.weight_version = s + 1  # after the step's update
        example = ("vault0_s1_t2", 3) if s == 1 else None
        batch.stats = StepStats(episodes=16, invalid_example=example, metrics={"health/invalid_action_frac": share})
        monitor.on_train_batch_end(trainer, module, None, batch, s)
    return monitor


def test_format_monitor_stops_with_one_line_naming_the_step_share_and_episode(tmp_path):
    address = (tmp_path / "viewer.html").as_uri() + "#stream=train&step=1&task=vault0_s1_t2&sample=3"
    warned = r"step 1: 45.0% of the policy's actions were invalid over the last 2 steps, above warn_above 0.3.*"
    with pytest.warns(RuntimeWarning, match=warned + re.escape(address)), pytest.raises(FormatDriftError) as stop:
        format_step(tmp_path, [0.3, 0.6, 0.7])
    assert str(stop.value) == (
        "step 2: 65.0% of the policy's actions were invalid over the last 2 steps, above "
        "callbacks.format_monitor.stop_above=0.6 (the KL anchor, algorithm.kl_coef, and a smaller optim.lr keep it on "
        f"format); an invalid episode: {address}"
    )
    without = r"episode: step 1, task vault0_s1_t2, sample 3 \(no rollout viewer"
    with pytest.warns(RuntimeWarning, match=without), pytest.raises(FormatDriftError, match=without):
        format_step(tmp_path, [0.3, 0.6, 0.7], viewer=False)


@pytest.mark.parametrize(
    "override,message",
    [
        ("callbacks.format_monitor.stop_above=1.5", "stop_above=1.5 must be a share in [0, 1), e.g. 0.5, or null"),
        ("callbacks.format_monitor.warn_above=-0.1", "warn_above=-0.1 must be a share in [0, 1), e.g. 0.25"),
        ("callbacks.format_monitor.window=0", "window=0 must be a number of steps >= 1"),
    ],
)
def test_format_monitor_settings_are_checked_with_the_fix(override, message):
    with pytest.raises(ConfigError, match=re.escape(f"callbacks.format_monitor.{message}")):
        build_callbacks(config(override))


def test_quarantine_stats_totals_and_warning():
    stats = QuarantineStats(warn_rate=0.1)
    trainer, module, batch = step(stats=StepStats(episodes=20, quarantined={"worker_dead": 1}))
    stats.on_train_batch_end(trainer, module, None, batch, 0)
    assert module.logged == {"quarantine/rate": 0.05, "quarantine_total/worker_dead": 1.0, "quarantine_total/all": 1.0}
    batch.stats = StepStats(episodes=20, quarantined={"worker_dead": 1, "infra": 3})
    with pytest.warns(RuntimeWarning, match=r"20.0% of episodes quarantined \(worker_dead=1, infra=3\)"):
        stats.on_train_batch_end(trainer, module, None, batch, 1)
    assert stats.totals == {"worker_dead": 2, "infra": 3, "all": 5}
    resumed = QuarantineStats()
    resumed.load_state_dict(stats.state_dict())
    assert resumed.totals == stats.totals


def test_coverage_numbers_on_a_hand_built_batch():
    a, b, c = Task("a", 1, "s"), Task("b", 3, "s"), Task("c", 3, "s")
    trajectories = [trajectory(a, 0, True)] + [trajectory(a, i, False) for i in (1, 2, 3)]
    trajectories += [trajectory(b, i, False) for i in range(4)] + [trajectory(c, i, i == 0) for i in range(4)]
    stats = StepStats.of(same_task_groups(trajectories, [4, 4, 4]), "sparse")
    metrics = stats.metrics
    assert metrics["coverage/groups_tier1"] == 1 and metrics["coverage/groups_tier3"] == 2
    assert metrics["coverage/mixed_tier1"] == 1.0
    assert metrics["coverage/all_fail_tier3"] == 0.5 and metrics["coverage/mixed_tier3"] == 0.5
    assert metrics["coverage/all_success_tier3"] == 0.0 and metrics["coverage/group_size"] == 4
    trainer, module, batch = step(batch_metrics=metrics, stats=stats)
    CoverageLogger().on_train_batch_end(trainer, module, None, batch, 0)
    # tier 1: p = 1/4, n = 4 -> 1 - 0.25^4 - 0.75^4; tier 3: p = 1/8
    assert module.logged["coverage/psig_tier1"] == pytest.approx(1 - 0.25**4 - 0.75**4) == pytest.approx(0.6796875)
    assert module.logged["coverage/psig_tier3"] == pytest.approx(signal_coverage(0.125, 4))
    assert module.logged["coverage/psig"] == pytest.approx((0.6796875 + 2 * signal_coverage(0.125, 4)) / 3)


def test_build_callbacks_swaps_by_config():
    kinds = {type(c) for c in build_callbacks(config())}
    assert kinds == {
        QuarantineStats,
        CoverageLogger,
        EntropyMonitor,
        FormatMonitor,
        BudgetTransferEval,
        OnPolicyAudit,
        RolloutViewer,
        StepProgress,
    }
    assert StepProgress not in {type(c) for c in build_callbacks(config("callbacks.progress=null"))}
    with pytest.raises(ConfigError, match=r"^callbacks.progress.every_n_steps=0 must be a positive integer"):
        build_callbacks(config("callbacks.progress.every_n_steps=0"))
    assert EntropyMonitor not in {type(c) for c in build_callbacks(config("callbacks.entropy_monitor=null"))}
    assert build_callbacks(config("callbacks=none")) == []


def test_budget_transfer_evaluates_both_budgets_with_the_runs_own_engine(tiny_path, tmp_path):
    cfg = config(f"model.path={tiny_path}")
    run_config = OmegaConf.create({k: cfg[k] for k in ("seed", "budget", "sampling")})
    run_config.budget.max_turns = 2  # keep the untrained model's episodes short
    callback = BudgetTransferEval(run_config, cfg.eval.enlarged, split="test", k=1)
    callback.configs["enlarged_budget"].budget.max_turns = 3
    callback.configs["enlarged_budget"].budget.max_response_tokens = 48
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    engine = LocalEngine(tiny_path, stop_token_ids=[0], pad_token_id=0, seed=11)
    engine.weight_version = 7
    training_sampler = engine.generator.get_state()
    logger = SimpleNamespace(logged={}, log_metrics=lambda metrics, step: logger.logged.update(metrics))
    log = TrajectoryLog(tmp_path / "trajectories", tokenizer, tiny_path, logged_episodes(), "sparse")
    datamodule = SimpleNamespace(
        engine=engine, env=EmbeddedEnvironment(), tokenizer=tokenizer, max_quarantine_fraction=0.5, trajectory_log=log
    )
    trainer = SimpleNamespace(
        global_step=7,
        is_global_zero=True,
        world_size=1,
        loggers=[logger],
        default_root_dir=str(tmp_path),
        datamodule=datamodule,
    )
    module = SimpleNamespace(weight_version=7, iter_hf_weights=lambda: iter(()))
    callback.on_train_end(trainer, module)
    assert {"eval/training_budget/tgc_all", "eval/enlarged_budget/tgc_tier3"} <= set(logger.logged)
    assert all(0.0 <= v <= 1.0 for v in logger.logged.values())
    log.close()  # each budget's episodes went to the trajectory log, as of the step they evaluated
    for stream in ("eval_embedded", "eval_embedded_enlarged"):
        episodes = read_step(tmp_path / "trajectories" / stream / "step_000007.jsonl.gz")
        assert len(episodes) == 18 and {r["weight_versions"][0] for r in episodes if r["weight_versions"]} == {7}
    # neither budget scales RoPE: both were served by the lent engine itself, its training sampler untouched
    assert engine.siblings == {} and torch.equal(engine.generator.get_state(), training_sampler)
    assert "embedded_enlarged (3t/48)" in (tmp_path / "budget_transfer.md").read_text()
    assert (tmp_path / "fig5_budget_transfer.png").stat().st_size > 10_000
    # a budget with YaRN gets an in-process sibling holding the same weights, built once
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    sibling = engine.at_budget(2048, yarn)
    assert sibling is engine.at_budget(2048, yarn) is not engine and sibling.weight_version == 7
    assert all(torch.equal(a, b) for a, b in zip(sibling.model.parameters(), engine.model.parameters()))


@pytest.mark.slow
def test_training_run_logs_and_plots_the_callbacks(short_run):
    run_dir, run = short_run
    assert "eval.every_n_steps=1" in run.args
    scalars = read_scalars(run_dir / "tensorboard")
    for tag in (
        "coverage/psig",
        "coverage/psig_tier1",
        "coverage/all_fail_tier1",
        "quarantine/rate",
        "quarantine_total/all",
        "eval/training_budget/tgc_all",
        "eval/enlarged_budget/tgc_tier3",
    ):
        assert tag in scalars, tag
    assert len(scalars["eval/training_budget/tgc_all"]) == 3  # after steps 1, 2 and 3; the end reuses step 3
    for name in (
        "fig2_coverage",
        "fig3_group_composition",
        "fig4_entropy_score",
        "fig5_budget_transfer",
        "learning_curve",
    ):
        assert (run_dir / f"{name}.png").stat().st_size > 10_000, name
    assert math.isfinite(scalars["coverage/psig"][0][1])
    page = (run_dir / "viewer.html").read_text()  # built at the end, after the figures
    assert page.count('src="data:image/png;base64,') == 5 and '"eval_embedded_enlarged"' in page
