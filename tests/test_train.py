"""End to end through `python train.py`: a short run of the embedded default, and the base policy's rates."""

import json
import math
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer, Qwen3ForCausalLM

from canopy.build import build_datamodule
from canopy.reports.summary import training_task_report
from canopy.reports.tb_scalars import read_scalars
from canopy.trajectories import read_index, read_step
from tests.helpers import config, train

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_TAGS = [
    "reward/mean",
    "reward/success",
    "success/tier1",
    "success/tier2",
    "success/tier3",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/loss",
    "mismatch/logprob_gap",
    "mismatch/kl",
    "mismatch/seq_log_ratio",
    "mismatch/seq_abs_log_ratio",
    "rollout/response_length",
    "rollout/turns",
    "rollout/truncated_frac",
    "rollout/quarantined",
    "time/generation",
    "time/env",
    "time/reference",
    "time/update",
    "time/weight_sync",
    "coverage/mixed",
    "coverage/all_fail",
    "coverage/all_success",
    "health/invalid_action_frac",
]


@pytest.mark.slow
def test_short_training_run(short_run):
    run_dir, run = short_run
    scalars = read_scalars(run_dir / "tensorboard")
    for tag in REQUIRED_TAGS:
        assert tag in scalars and len(scalars[tag]) == 3, tag
        assert all(math.isfinite(v) for _, v in scalars[tag]), tag
    # the engine samples from the trainer's weights at every step: float32 in-process engine, in sync
    assert all(v < 1e-5 for _, v in scalars["mismatch/logprob_gap"]), scalars["mismatch/logprob_gap"]
    assert not any(tag.startswith("correction/") for tag in scalars)  # the recipe corrects nothing
    assert scalars["actor/kl"][0][1] == 0.0  # step 0: the policy still is the reference
    final = run_dir / "final_hf"
    Qwen3ForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["base"]) == {"all", "tier1", "tier2", "tier3"} == set(summary["final"])
    assert all(0 <= v <= 1 for when in ("base", "final") for v in summary["invalid_action_frac"][when].values())
    assert "all" in summary["invalid_action_frac"]["final"] and "Invalid actions" in run.stdout
    assert (run_dir / "learning_curve.png").stat().st_size > 10_000
    assert "Success on the training tasks" in run.stdout
    # every step's episodes are logged (4 tasks x 4 rollouts), and the budget-transfer evaluations at the end
    logs = run_dir / "trajectories"
    assert sorted(p.name for p in (logs / "train").glob("step_*")) == [f"step_{i:06d}.jsonl.gz" for i in range(3)]
    assert [s["step"] for s in read_index(logs / "train")] == [0, 1, 2]
    steps = [read_step(logs / "train" / f"step_{i:06d}.jsonl.gz") for i in range(3)]
    assert [len(records) for records in steps] == [16] * 3 and all(r["step"] == 2 for r in steps[2])
    assert steps[2][0]["weight_versions"] == [2]  # sampled by the weights after two updates
    for budget in ("embedded", "embedded_enlarged"):  # after each step; the end reuses step 3's
        evaluated = read_step(logs / f"eval_{budget}" / "step_000003.jsonl.gz")
        assert len(evaluated) == 18 and all(r["advantage"] is None for r in evaluated), budget
    assert "rollout viewer: " in run.stdout and (run_dir / "viewer.html").stat().st_size > 10_000
    # the three benign Lightning warnings are silenced by their exact text (train.py); nothing else warns
    for benign in (
        "`dataloader_iter` step flavor",
        "Found `dataloader_iter` argument",
        "module(s) in eval mode",
        "LeafSpec",
    ):
        assert benign not in run.stderr, benign
    assert "Warning" not in run.stderr and ".py:" not in run.stderr, run.stderr[-2000:]


@pytest.mark.slow
def test_base_policy_of_the_embedded_default(tmp_path):
    """Coverage effects need a hard tier the base rarely solves and an easy tier it often does."""
    cfg = config(f"model.tiny.dir={tmp_path / 'tiny'}")
    from canopy.build import ensure_model

    datamodule = build_datamodule(cfg, ensure_model(cfg))
    rates = training_task_report(datamodule, samples_per_task=16, description="base")["success"]
    assert rates["tier3"] <= 0.1
    assert 0.3 <= rates["tier1"] <= 0.8
    assert rates["tier1"] > rates["tier2"] > rates["tier3"]


@pytest.mark.slow
def test_training_through_the_environment_pool(short_run):
    """The embedded default with its episodes served by 4 isolated worker processes: runs, nothing quarantined."""
    run_dir, run = short_run
    assert "env.pool.workers=4" in run.args
    scalars = read_scalars(run_dir / "tensorboard")
    assert [v for _, v in scalars["rollout/episodes"]] == [16, 16, 16]
    assert [v for _, v in scalars["rollout/quarantined"]] == [0, 0, 0]


@pytest.mark.slow
def test_half_minibatch_run_counts_rollout_steps(tmp_path, warm_tiny):
    """trainer.max_steps counts rollout steps: the half_minibatch ablation takes two Lightning optimizer steps on
    each, and its second update learns from samples of the weights before the first (the trainer ratio moves)."""
    run_dir, _ = train(
        tmp_path, warm_tiny, 2, "ablation=half_minibatch", "report.eval_samples_per_task=0", "callbacks=none"
    )
    scalars = read_scalars(run_dir / "tensorboard")
    assert [step for step, _ in scalars["reward/success"]] == [0, 1]
    assert any(v != 0.0 for _, v in scalars["actor/ppo_kl"])


@pytest.mark.slow
def test_auto_group_sizes_run_under_the_fixed_rollout_budget(tmp_path, warm_tiny):
    """`ablation=auto_group`: every step runs tasks_per_step x adaptive_group.mean episodes, split by Eq. 5 per task
    (the first step evenly: the pilot), and logs each tier's mean group size and its Eq. 4 coverage."""
    overrides = ("ablation=auto_group", "algorithm.adaptive_group.mean=4", "algorithm.adaptive_group.floor=2")
    run_dir, _ = train(tmp_path, warm_tiny, 3, *overrides, "report.eval_samples_per_task=0")
    scalars = read_scalars(run_dir / "tensorboard")
    assert [v for _, v in scalars["rollout/episodes"]] == [16.0, 16.0, 16.0]
    tiers = [tag for tag in scalars if tag.startswith("coverage/group_size_tier")]
    assert tiers and all(2 <= v <= 16 for tag in tiers for _, v in scalars[tag])
    assert all(tag.replace("group_size", "psig") in scalars for tag in tiers)  # Eq. 4 at each tier's own sizes


@pytest.mark.slow
def test_audit_and_its_config_stop_the_run_with_one_line(tmp_path, warm_tiny):
    """A parity bound the engine cannot meet stops the run before any update with the audit's one-line message;
    an engine dtype with no bounds is a config error."""
    _, run = train(tmp_path, warm_tiny, 2, "engine.gap_bounds.float32.parity=1e-12", name="parity", returncode=1)
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("off-policy: update 0 (rollout step 0): before any update the engine's logprobs")
    assert "Traceback" not in run.stderr and not (tmp_path / "parity" / "final_hf").exists()
    _, run = train(tmp_path, warm_tiny, 2, "~engine.gap_bounds.float32", name="no_bounds", returncode=1)
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith("config error: engine.gap_bounds has no bounds for an engine computing in float32")
    )


# Drives the tiny policy off format within a few steps: no KL anchor, a large step and an entropy bonus push it to
# random tokens (measured: 7 of 74 actions invalid at step 0, 1/73, 25/55, then 60/80 at step 3, where a 2-step
# window's mean first passes 0.5); 8 tokens a turn keep the random replies short.
DRIFT = (
    "optim.lr=0.003",
    "algorithm.kl_coef=0",
    "algorithm.entropy_coef=1.0",
    "budget.per_turn_generation_cap=8",
    "report.eval_samples_per_task=0",
    "callbacks.format_monitor.window=2",
    "callbacks.format_monitor.stop_above=0.5",
)


@pytest.mark.slow
def test_a_run_driven_off_format_is_stopped_with_one_line_naming_an_invalid_episode(tmp_path, warm_tiny):
    """The format monitor stops a drifting run: one line naming the step, the window's invalid share and the viewer
    address of an invalid episode, which the page built at the stop opens; the share rose to get there."""
    run_dir, run = train(tmp_path, warm_tiny, 10, *DRIFT, returncode=1)
    last = run.stderr.strip().splitlines()[-1]
    stop = re.fullmatch(
        r"format drift: step (\d+): ([\d.]+)% of the policy's actions were invalid over the last 2 steps, above "
        r"callbacks.format_monitor.stop_above=0.5 \(.*\); an invalid episode: (\S+)#stream=train&step=(\d+)&task=(\S+)"
        r"&sample=(\d+)",
        last,
    )
    assert stop, last
    step, share, page, shown_step, task, sample = stop.groups()
    assert int(step) < 9 and float(share) > 50 and "Traceback" not in run.stderr
    assert page == (run_dir / "viewer.html").as_uri() and (run_dir / "viewer.html").stat().st_size > 10_000
    records = read_step(run_dir / "trajectories" / "train" / f"step_{int(shown_step):06d}.jsonl.gz")
    episode = next(r for r in records if r["task_id"] == task and r["sample_index"] == int(sample))
    assert episode["invalid_turns"] and episode["actions"] >= len(episode["invalid_turns"])
    shares = [
        invalid / answered
        for invalid, answered in (s["invalid_actions"] for s in read_index(run_dir / "trajectories" / "train"))
    ]
    assert len(shares) == int(step) + 1 and shares[0] < 0.2 and (shares[-1] + shares[-2]) / 2 > 0.5  # it rose
    logged = read_scalars(run_dir / "tensorboard")["health/invalid_action_frac"]
    assert [v for _, v in logged] == pytest.approx(shares[: len(logged)]) and not (run_dir / "final_hf").exists()


@pytest.mark.slow
def test_embedded_default_with_a_tiny_qwen3_5(tmp_path, warm_tiny_qwen3_5):
    """`python train.py model.tiny.family=qwen3_5`: the same run on a tiny Qwen3.5 (Gated DeltaNet + full attention),
    the trainer on TorchTitan's model with the pure-torch kernels, the engine on HF's; the engine samples what the
    trainer scores, and the final checkpoint is a complete HF Qwen3.5."""
    from transformers import Qwen3_5ForCausalLM

    run_dir, run = train(tmp_path, warm_tiny_qwen3_5, 2, "model.tiny.family=qwen3_5", "report.eval_samples_per_task=0")
    scalars = read_scalars(run_dir / "tensorboard")
    assert len(scalars["actor/loss"]) == 2 and all(v < 1e-4 for _, v in scalars["mismatch/logprob_gap"])
    Qwen3_5ForCausalLM.from_pretrained(run_dir / "final_hf")
    assert "Warning" not in run.stderr and ".py:" not in run.stderr, run.stderr[-2000:]
