"""Evaluation that cannot silently mislead: `evaluate.py` takes the environment and model of the run it evaluates
(the command line's own win), and a budget past the model's positions is refused unless its RoPE scaling covers
them, at the start of training or evaluation."""

import pytest
from omegaconf import OmegaConf

from canopy.config import check_context, compose_config
from canopy.errors import ConfigError
from canopy.eval.from_run import inherited_overrides, run_dir_of
from tests.helpers import config


@pytest.fixture
def run(tmp_path):
    """A training run's folder as train.py leaves it: Hydra's record of its overrides, its exports."""
    run = tmp_path / "outputs" / "run"
    (run / ".hydra").mkdir(parents=True)
    overrides = ["env.name=mypkg.letters", "model.tiny.tokenizer=byte", "trainer.max_steps=3", "+env.extra=1",
                 "budget@eval.enlarged=embedded", "experiment=embedded", f"hydra.run.dir={run}"]  # fmt: skip
    OmegaConf.save(OmegaConf.create(overrides), run / ".hydra" / "overrides.yaml")
    (run / "final_hf").mkdir()
    (run / "checkpoints").mkdir()
    return run


def test_a_checkpoint_of_a_run_brings_the_runs_experiment_environment_and_model(run, tmp_path):
    assert run_dir_of(run / "final_hf") == run_dir_of(run / "checkpoints" / "last.ckpt") == run
    assert run_dir_of(tmp_path / "elsewhere" / "final_hf") is None
    taken = ["env.name=mypkg.letters", "model.tiny.tokenizer=byte", "+env.extra=1", "experiment=embedded"]
    assert inherited_overrides([f"checkpoint={run}/final_hf", "k=2"]) == (run, taken)
    assert inherited_overrides([f"checkpoint={run}/checkpoints/last.ckpt"]) == (run, taken)
    # the command line's own keys win: a key, or a node above it, given again drops the run's
    assert inherited_overrides([f"checkpoint={run}/final_hf", "env.name=embedded"])[1] == taken[1:]
    assert inherited_overrides([f"checkpoint={run}/final_hf", "env=python_tasks"])[1] == [taken[1], taken[3]]
    assert inherited_overrides([f"checkpoint={run}/final_hf", "model.path=/m"])[1] == taken  # a sibling key
    assert inherited_overrides([f"checkpoint={run}/final_hf", "experiment=testbed"]) == (run, [])
    # the base model, or a checkpoint from elsewhere, brings nothing
    assert inherited_overrides(["k=2"]) == inherited_overrides(["checkpoint=null"]) == (None, [])
    assert inherited_overrides([f"checkpoint={tmp_path}/elsewhere/final_hf"]) == (None, [])


def test_a_budget_past_the_models_positions_is_refused_unless_rope_scaling_covers_it(tiny_path):
    """The embedded model has 2,048 positions: the AppWorld enlarged budget (61,440 over YaRN x1.5 of Qwen3's 40,960)
    is refused in evaluation and, as the budget-transfer callback's, at the start of training."""
    check_context(config(), tiny_path)  # the embedded default and its enlarged budget fit
    with pytest.raises(ConfigError) as refused:
        check_context(compose_config(["budget=enlarged"], "evaluate"), tiny_path, training=False)
    assert str(refused.value) == (
        "budget=enlarged's rope_scaling stretches 40,960 positions, but the model has 2,048: it was written for "
        "another model; pick a budget for this one (the embedded model's: budget=embedded_enlarged)"
    )
    with pytest.raises(ConfigError, match=r"^eval.enlarged.budget=enlarged's rope_scaling .*budget@eval.enlarged=embe"):
        check_context(config("budget@eval.enlarged=enlarged"), tiny_path)
    check_context(config("budget@eval.enlarged=enlarged", "callbacks.budget_transfer=null"), tiny_path)  # not run
    with pytest.raises(ConfigError, match=r"^budget=embedded asks for a 4,096-token context, past the model's 2,048 "):
        check_context(config("budget.max_context_tokens=4096"), tiny_path)
    # a budget whose YaRN stretches this model's 2,048 positions far enough
    scaled = ["budget=enlarged", "budget.max_context_tokens=4096"]
    scaled += ["budget.rope_scaling.original_max_position_embeddings=2048"]
    with pytest.raises(ConfigError, match=r"past the 3,072 positions its rope_scaling \(x1.5 over 2,048\) covers: "
                       r"raise budget.rope_scaling.factor to at least 2.00"):  # fmt: skip
        check_context(config(*scaled), tiny_path)
    check_context(config(*scaled, "budget.rope_scaling.factor=2.0"), tiny_path)
