"""Evaluation math (Table 3), the pilot (Eq. 5), checkpoints and YaRN in the engine, and evaluate.py end to end."""

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from canopy.config import compose_config, validate_eval
from canopy.envs.base import Task
from canopy.envs.embedded import EmbeddedEnvironment, make_tasks
from canopy.errors import ConfigError
from canopy.eval.metrics import best_at_k, mean_at_k, sgc, sgc_best_at_k, sgc_mean_at_k, summarize
from canopy.eval.pilot import format_pilot, pilot_report
from canopy.eval.runner import (
    Sampled,
    checkpoint_weights,
    evaluation,
    format_scenarios,
    format_table3,
    sample_runs,
    write_results,
)
from canopy.modules.policy import load_policy
from canopy.reports.summary import write_summary
from canopy.rollout.budget import Budget
from canopy.rollout.local import LocalEngine
from canopy.rollout.trajectory import invalid_action_fracs
from canopy.trajectories import read_step
from tests.helpers import UNFILTERED
from tests.scripted import ScriptedEngine

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"a": [1, 0, 1, 1], "b": [0, 1, 0, 0], "c": [1, 1, 1, 1]}
SCENARIO = {"a": "s1", "b": "s1", "c": "s2"}


def test_mean_and_best_at_k_by_hand():
    assert mean_at_k(RUNS) == pytest.approx((0.75 + 0.25 + 1.0) / 3)
    assert best_at_k(RUNS) == 1.0  # every task solved by some run
    assert best_at_k({"a": [0, 0], "b": [0, 1]}) == 0.5


def test_tgc_and_sgc_by_hand():
    assert mean_at_k({"a": [1], "b": [0], "c": [1]}) == pytest.approx(2 / 3)  # TGC of one run
    assert sgc({"a": 1, "b": 0, "c": 1}, SCENARIO) == 0.5  # s1 fails on b, s2 passes
    # run j of every task: s1 never has both a and b solved in the same run, s2 always passes
    assert sgc_mean_at_k(RUNS, SCENARIO) == 0.5
    assert sgc_best_at_k(RUNS, SCENARIO) == 1.0  # the union solves a and b


def test_summarize_per_tier():
    tasks = [Task("a", 1, "s1"), Task("b", 2, "s1"), Task("c", 1, "s2"), Task("d", 2, "s3")]
    summary = summarize(tasks, {**RUNS, "d": []})  # d has no scored run (all quarantined): left out
    assert summary["all"]["tasks"] == 3 and summary["all"]["tgc_mean"] == pytest.approx(2 / 3)
    assert summary["tier1"] == {"tasks": 2, "tgc_mean": pytest.approx(0.875), "tgc_best": 1.0}  # one task per scenario
    assert summary["tier2"]["tgc_mean"] == 0.25 and summary["tier2"]["tgc_best"] == 1.0
    assert summary["all"]["sgc_mean"] == 0.5 and summary["all"]["sgc_best"] == 1.0
    table = format_table3([{"policy": "p", "budget": "b", "split": "dev", "k": 4, "metrics": summary}])
    assert (
        "| TGC m@4 | TGC b@4 | SGC m@4 | SGC b@4 |" in table
        and "| p | b | dev | all (3) | 66.7 | 100.0 | 50.0 | 100.0 |" in table
    )


def test_the_summary_compares_base_and_final_success_and_invalid_action_share(tokenizer, tmp_path):
    """summary.json / .md: success and format health, base vs final, by tier; the share from the evaluation's scored
    episodes (`sample_runs`), over the actions their environment answered."""
    tasks = [t for t in make_tasks("train") if t.spec["start"] == 0][:2]  # tiers 1 and 2 of vault 0
    budget = Budget(max_turns=3, max_response_tokens=64, max_prompt_tokens=128, max_observation_tokens=32,
                    max_context_tokens=512)  # fmt: skip
    engine = ScriptedEngine(tokenizer, ["hello", "login", "hello"])
    sampled = sample_runs(engine, EmbeddedEnvironment(), tokenizer, tasks, 1, budget, UNFILTERED)
    assert sampled.actions_by_tier == {1: [1, 2], 2: [2, 3]}  # tier 1 done at its login; tier 2 at the turn limit
    assert invalid_action_fracs(sampled.actions_by_tier) == {"all": 0.6, "tier1": 0.5, "tier2": pytest.approx(2 / 3)}
    assert invalid_action_fracs({3: [0, 0]}) == {}  # nothing answered: no share
    record = evaluation(tasks, sampled, policy="scripted", budget="b", split="train", k=1)  # evaluate.py's record
    assert record["invalid_action_frac"] == invalid_action_fracs(sampled.actions_by_tier)
    assert "invalid actions: all 60.0%, tier1 50.0%, tier2 66.7%" in format_scenarios(record)
    base = {"success": {"all": 0.5, "tier1": 0.75}, "invalid_action_frac": {"all": 0.1, "tier1": 0.2}}
    final = {"success": {"all": 0.75, "tier1": 1.0}, "invalid_action_frac": {"all": 0.3}}
    tables = write_summary(tmp_path, base, final)
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "base": {"all": 0.5, "tier1": 0.75},
        "final": {"all": 0.75, "tier1": 1.0},
        "invalid_action_frac": {"base": {"all": 0.1, "tier1": 0.2}, "final": {"all": 0.3}},
    }
    health = tables.split("Invalid actions")[1]
    assert "| all | 0.100 | 0.300 | +0.200 |" in health and "tier1" not in health  # only rows both have
    assert (tmp_path / "summary.md").read_text().endswith(tables + "\n")


def test_pilot_report_follows_eq_4_and_5():
    report = pilot_report({"tier1": (0.5, 100), "tier3": (0.05, 100)}, tau=0.9, group_sizes=[8, 32])
    assert report["hardest"] == "tier3"
    assert report["recommended_group_size"] == math.ceil(math.log(0.1) / math.log(0.95)) == 45
    assert report["tiers"]["tier3"]["p_sig"]["8"] == pytest.approx(1 - 0.05**8 - 0.95**8)  # 0.337, Fig. 2a
    assert report["tiers"]["tier3"]["p_sig"]["32"] == pytest.approx(0.806, abs=1e-3)
    zero = pilot_report({"tier3": (0.0, 20)}, tau=0.9, group_sizes=[8])
    assert zero["recommended_group_size"] == 45 and "no success in 20" in zero["tiers"]["tier3"]["note"]  # p < 1/20
    assert pilot_report({"tier1": (1.0, 10)}, 0.9, [8])["tiers"]["tier1"]["n_eq5"] is None  # saturated
    assert "group size n >= 45" in format_pilot(report, [8, 32])


def test_checkpoint_weights(tiny_path, tmp_path):
    assert checkpoint_weights(tiny_path, str(tiny_path)) == (str(tiny_path), None)
    with pytest.raises(ConfigError, match="does not exist"):
        checkpoint_weights(tmp_path / "missing", str(tiny_path))
    policy, _ = load_policy(tiny_path)
    state = {f"policy.{k}": v + 1.0 for k, v in policy.state_dict().items()}
    torch.save({"state_dict": state}, tmp_path / "last.ckpt")
    path, weights = checkpoint_weights(tmp_path / "last.ckpt", str(tiny_path))
    hf = dict(weights)
    base = LocalEngine(tiny_path, stop_token_ids=[0], pad_token_id=0).model.state_dict()
    assert path == str(tiny_path) and set(hf) <= set(base)
    assert torch.equal(hf["model.norm.weight"], base["model.norm.weight"] + 1.0)


def test_local_engine_applies_yarn_only_when_set(tiny_path):
    plain = LocalEngine(tiny_path, stop_token_ids=[0], pad_token_id=0)
    assert plain.model.config.rope_parameters["rope_type"] == "default"  # null rope_scaling is a no-op
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}
    scaled = LocalEngine(tiny_path, stop_token_ids=[0], pad_token_id=0, rope_scaling=yarn)
    assert (
        scaled.model.config.rope_parameters["rope_type"] == "yarn"
        and scaled.model.config.rope_parameters["factor"] == 2.0
    )
    x = torch.arange(12).unsqueeze(0)
    assert not torch.allclose(plain.model(x).logits, scaled.model(x).logits)


def evaluate(tiny_path, tmp_path, *args):
    command = [sys.executable, "evaluate.py", f"hydra.run.dir={tmp_path}", f"model.path={tiny_path}", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_evaluate_end_to_end(tiny_path, tmp_path):
    first = evaluate(tiny_path, tmp_path / "training", f"checkpoint={tiny_path}", "k=1", "split=test", "policy=tiny")
    assert first.returncode == 0, first.stderr[-2000:]
    result = json.loads((tmp_path / "training" / "eval.json").read_text())[0]
    assert (result["policy"], result["split"], result["k"], result["budget"]) == (
        "tiny",
        "test",
        1,
        "embedded (5t/256)",
    )
    assert set(result["metrics"]) == {"all", "tier1", "tier2", "tier3"} and result["metrics"]["all"]["tasks"] == 18
    assert "| Policy | Budget |" in (tmp_path / "training" / "eval.md").read_text()
    logged = read_step(tmp_path / "training" / "trajectories" / "eval_embedded" / "step_000000.jsonl.gz")
    assert sorted(r["task_id"] for r in logged) == sorted(t.task_id for t in make_tasks("test"))  # k=1 run each
    assert all(r["turns"] and r["reward"] == float(r["verdict"]["success"]) for r in logged)
    # the untrained tiny model rambles: cap the enlarged budget's tokens to keep the test short
    second = evaluate(
        tiny_path,
        tmp_path / "enlarged",
        "budget=embedded_enlarged",
        "budget.max_turns=6",
        "budget.max_response_tokens=48",
        "k=1",
        "split=test",
        f"transfer_from={tmp_path / 'training' / 'eval.json'}",
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert "embedded_enlarged (6t/48)" in second.stdout and "| base |" in second.stdout
    assert (tmp_path / "enlarged" / "fig5_budget_transfer.png").stat().st_size > 10_000


@pytest.mark.slow
def test_evaluate_missing_checkpoint_is_one_line(tiny_path, tmp_path):
    run = evaluate(tiny_path, tmp_path, f"checkpoint={tmp_path / 'nope'}")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith("config error: checkpoint") and "final_hf" in run.stderr


@pytest.mark.slow
def test_pilot_prints_group_size(tiny_path, tmp_path):
    run = evaluate(tiny_path, tmp_path, "pilot=true", "pilot_samples=1", "tau=0.9", "budget.max_response_tokens=48")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (
        "| tier | p | episodes | n (Eq. 5) | P_sig n=4 | P_sig n=8 | P_sig n=16 | P_sig n=32 | P_sig n=64 |"
        in run.stdout
    )
    report = json.loads((tmp_path / "pilot.json").read_text())
    assert set(report["tiers"]) == {"tier1", "tier2", "tier3"} and report["tiers"]["tier1"]["episodes"] == 24
    assert "for coverage tau=0.9: group size n >=" in run.stdout


def test_evaluate_refuses_a_checkpoint_or_transfer_it_cannot_read_in_one_line(tmp_path, tiny_path):
    """evaluate.py's `checkpoint` is an HF directory or a Lightning .ckpt, its `transfer_from` an eval.json that
    evaluate.py wrote: anything else is refused before the run starts, saying what it is not; the real ones pass."""
    fix = "pass an HF checkpoint directory (e.g. <run dir>/final_hf) or a single-file .ckpt written by checkpoint."
    sharded, other = tmp_path / "step4.ckpt", tmp_path / "notes"
    for folder, names in ((sharded, (".metadata", "meta.pt")), (other, ("a.txt",))):
        folder.mkdir()
        for name in names:
            (folder / name).write_bytes(b"")
    said = {
        "README.md": "is neither an HF checkpoint directory (config.json + *.safetensors) nor a Lightning .ckpt",
        str(other): "is neither an HF checkpoint directory (config.json + *.safetensors) nor a Lightning .ckpt",
        str(sharded): "is a sharded (multi-process) training checkpoint, which evaluate.py does not load",
    }
    for checkpoint, problem in said.items():
        with pytest.raises(ConfigError) as error:
            validate_eval(compose_config([f"checkpoint={checkpoint}"], "evaluate"))
        assert str(error.value).startswith(f"checkpoint '{checkpoint}' {problem}: {fix}")
    torch.save({"state_dict": {}}, tmp_path / "last.ckpt")
    tasks = make_tasks("test")[:2]
    sampled = Sampled({task.task_id: [1.0] for task in tasks}, 0, Counter(), {})
    meta = dict(policy="base", checkpoint=None, budget="b", split="test", k=1)  # evaluate.py's
    write_results(tmp_path, "eval", [evaluation(tasks, sampled, **meta)])
    for good in (
        f"checkpoint={tiny_path}",
        f"checkpoint={tmp_path / 'last.ckpt'}",
        f"transfer_from={tmp_path}/eval.json",
    ):
        validate_eval(compose_config([good], "evaluate"))
    for transfer in ("README.md", tmp_path, tmp_path / "eval.md"):
        with pytest.raises(ConfigError) as error:
            validate_eval(compose_config([f"transfer_from={transfer}"], "evaluate"))
        assert str(error.value) == (
            f"transfer_from '{transfer}' is not an eval.json written by evaluate.py: pass one, e.g. "
            "<eval run dir>/eval.json"
        )
