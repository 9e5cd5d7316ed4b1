import subprocess
import sys
from pathlib import Path

import pytest
import torch

from canopy.build import build_env
from canopy.config import compose_config, validate
from canopy.errors import ConfigError

CORRECTION_OFF = {"mode": "none", "tis_cap": 2.0, "token_bounds": [0.5, 5.0], "sequence_bounds": [0.99, 1.01]}


def config(*overrides):
    return compose_config(overrides)


def test_default_is_the_embedded_experiment_and_valid():
    cfg = config()
    validate(cfg)
    assert cfg.env.name == "embedded" and cfg.engine.name == "local" and cfg.model.tiny
    assert cfg.algorithm.minibatches_per_step == 1 and cfg.algorithm.loss_aggregation == "token-mean"
    assert cfg.budget.per_turn_generation_cap is None


def test_testbed_experiment_is_the_embedded_default_with_differing_tasks():
    cfg = config("experiment=testbed")
    validate(cfg)
    assert cfg.env.declare_done and cfg.model.tiny.declare_done and cfg.budget.max_turns == 8
    assert cfg.model.tiny.dir != config().model.tiny.dir  # its own base model, warmed on its own world
    assert build_env(cfg).declare_done and not build_env(config()).declare_done
    assert cfg.algorithm.group_size == config().algorithm.group_size and cfg.optim.lr == config().optim.lr


def test_appworld_experiment_holds_table_a1():
    cfg = config("experiment=appworld_canopy", "model.path=/models/qwen3-14b")
    a = cfg.algorithm
    assert (a.group_size, a.kl_coef, a.clip_low, a.clip_high, a.entropy_coef) == (32, 1e-4, 0.2, 0.2, 0.0)
    assert (a.reward, a.loss_aggregation, a.minibatches_per_step) == ("sparse", "token-mean", 1)
    assert (cfg.data.tasks_per_step, cfg.optim.lr, cfg.trainer.max_steps) == (90, 3e-6, 90)
    b = cfg.budget
    assert (b.max_turns, b.max_response_tokens, b.max_prompt_tokens, b.max_observation_tokens) == (
        50,
        32768,
        4096,
        4096,
    )
    assert b.per_turn_generation_cap is None and cfg.sampling.temperature == 0.9


def test_swebench_experiment_holds_table_a3():
    cfg = config("experiment=swebench_canopy", "model.path=/models/qwen3.5-9b")
    assert (cfg.algorithm.group_size, cfg.algorithm.kl_coef, cfg.optim.lr) == (16, 1e-2, 4e-6)
    assert (cfg.data.tasks_per_step, cfg.trainer.max_steps, cfg.sampling.temperature) == (64, 260, 1.0)
    assert (cfg.budget.max_turns, cfg.budget.max_response_tokens) == (80, 36864)


def test_enlarged_budget_matches_appendix_i():
    cfg = config("experiment=appworld_canopy", "model.path=/m", "budget=enlarged")
    assert (cfg.budget.max_turns, cfg.budget.max_context_tokens) == (100, 61440)
    assert cfg.budget.rope_scaling.factor == 1.5 and cfg.budget.rope_scaling.original_max_position_embeddings == 40960
    assert (cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.top_p) == (0.6, 20, 0.95)


@pytest.mark.parametrize(
    "ablation,key,value",
    [
        ("n8", "algorithm.group_size", 8),
        ("auto_group", "algorithm.group_size", "auto"),
        ("no_kl", "algorithm.kl_coef", 0.0),
        ("seq_mean", "algorithm.loss_aggregation", "seq-mean"),
        ("drop_hardest", "data.drop_hardest", True),
        ("dense_reward", "algorithm.reward", "dense"),
        ("half_minibatch", "algorithm.minibatches_per_step", 2),
        ("quarantine_as_failure", "algorithm.quarantine_as_failure", True),
        ("no_std", "algorithm.advantage_std", False),
        ("token_tis", "algorithm.rollout_correction", {**CORRECTION_OFF, "mode": "token_tis"}),
        ("token_mask", "algorithm.rollout_correction", {**CORRECTION_OFF, "mode": "token_mask"}),
        ("sequence_mask", "algorithm.rollout_correction", {**CORRECTION_OFF, "mode": "sequence_mask"}),
    ],
)
def test_each_ablation_changes_one_thing(ablation, key, value):
    """An ablation file changes one key; the recipe corrects no engine-trainer mismatch."""
    base, ablated = (
        config("experiment=appworld_canopy", "model.path=/m"),
        config("experiment=appworld_canopy", "model.path=/m", f"ablation={ablation}"),
    )
    section, name = key.split(".")
    assert ablated[section][name] == value and base.algorithm.rollout_correction == CORRECTION_OFF
    for s in ("algorithm", "data", "optim", "budget", "sampling"):
        for k in base[s]:
            if (s, k) != (section, name):
                assert base[s][k] == ablated[s][k], f"{ablation} also changed {s}.{k}"


@pytest.mark.parametrize(
    "override,message",
    [
        ("algorithm.group_size=1", "group_size"),
        ("algorithm.group_size=many", "or auto"),
        ("algorithm.adaptive_group.floor=1", "2 <= floor <= mean <= cap"),
        ("algorithm.adaptive_group.cap=8", "2 <= floor <= mean <= cap"),
        ("algorithm.adaptive_group.decay=1.5", "adaptive_group.decay"),
        ("algorithm.kl_coef=-0.1", "kl_coef"),
        ("algorithm.loss_aggregation=sum", "loss_aggregation"),
        ("algorithm.reward=shaped", "reward"),
        ("algorithm.clip_low=1.5", "clip_low"),
        ("sampling.temperature=0", "temperature"),
        ("sampling.top_p=1.5", "top_p"),
        ("budget.max_turns=0", "max_turns"),
        ("data.tasks_per_step=0", "tasks_per_step"),
        ("optim.lr=0", "lr"),
        ("env.name=webshop", "env.name"),
        ("model.tiny=null", "does not exist"),
        ("parallelism.tp=0", "parallelism.tp"),
        ("parallelism.mixed_precision=fp8", "mixed_precision"),
        ("parallelism.activation_checkpointing=some", "activation_checkpointing"),
        ("checkpoint.resume=/no/such.ckpt", "checkpoint.resume"),
        ("parallelism.cp=2", "context parallel needs GPUs"),
        ("env.pool.workers=-1", "env.pool.workers"),
        ("env.sandbox.wall_seconds=200", "request_timeout_s"),
        ("env.sandbox.memory_mb=8192", "env.pool.memory_mb"),
        ("env.sandbox.max_processes=0", "max_processes"),
    ],
)
def test_invalid_values_fail_with_the_key_named(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(config(override, "model.path=/no/such/dir"))


def test_context_parallel_is_refused_at_start_for_a_family_without_it():
    gpus = ("trainer.accelerator=gpu", "trainer.devices=2", "parallelism.cp=2")
    validate(config(*gpus))  # Qwen3 has it
    with pytest.raises(ConfigError, match="parallelism.cp=2 with model.family=qwen3_5: .* parallelism.tp instead"):
        validate(config(*gpus, "model.tiny.family=qwen3_5"))


def test_missing_model_path_names_the_fix():
    with pytest.raises(ConfigError, match="model.path"):
        validate(config("experiment=appworld_canopy"))


def test_unbuilt_components_say_so():
    with pytest.raises(ConfigError, match="env.name='webarena' has no environment in this build yet"):
        build_env(config("env.name=webarena"))
    with pytest.raises(ConfigError, match="select SWE-bench with env=swebench"):
        build_env(config("env.name=swebench"))
    with pytest.raises(ConfigError, match="select AppWorld with env=appworld"):
        build_env(config("env.name=appworld"))


def test_pool_setting_wraps_the_environment():
    cfg = config("env.name=python_tasks", "env.pool.workers=3")
    env = build_env(cfg)
    assert env.max_concurrent_episodes == 3 and env.worker_pids() == []  # workers start on first use
    assert env.settings.request_timeout_s == cfg.env.pool.request_timeout_s
    assert build_env(config()).name == "embedded"  # in-process by default


def train_cli(*overrides: str) -> subprocess.CompletedProcess:
    """`python train.py OVERRIDES` from the repository root."""
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=root, capture_output=True, text=True, timeout=300
    )


def test_cli_prints_one_line_and_fails():
    run = train_cli("algorithm.group_size=1")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [
        "config error: algorithm.group_size=1: group-relative advantages need >= 2 rollouts per task; "
        "set algorithm.group_size >= 2, or auto (per-task sizes, algorithm.adaptive_group)"
    ]


def test_a_mistyped_model_path_is_one_line_and_builds_nothing(tmp_path):
    """The embedded experiment builds its tiny model only at model.tiny.dir, never at a user's model.path."""
    typo, empty = tmp_path / "models" / "typo", tmp_path / "empty"
    empty.mkdir()
    fix = "point it at an HF checkpoint directory (config.json + *.safetensors + tokenizer)"
    run = train_cli(f"model.path={typo}")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [
        f"config error: model.path '{typo}' does not exist: {fix}, or leave model.path unset for the embedded tiny "
        "model"
    ]
    with pytest.raises(ConfigError) as error:  # the same check; the CLI's one-line form is asserted above
        validate(config(f"model.path={empty}"))
    assert str(error.value) == f"model.path '{empty}' has no config.json: {fix}"
    assert not typo.exists() and list(empty.iterdir()) == []


def test_print_config_is_true_or_false():
    validate(config("print_config=true"))
    with pytest.raises(ConfigError, match=r"^print_config='yes please' must be true or false$"):
        validate(config("print_config='yes please'"))


def test_quarantine_threshold_is_validated():
    for value in (0, 1.5, "half"):
        with pytest.raises(ConfigError, match="env.max_quarantine_fraction"):
            validate(config(f"env.max_quarantine_fraction={value}"))
    validate(config("env.max_quarantine_fraction=1.0"))


def test_environments_and_engines_are_config_groups_over_one_registry():
    from canopy.envs import available, environment_factory

    # the modules of canopy/envs/ defining ENVIRONMENT
    assert available() == ["appworld", "embedded", "python_tasks", "rgym", "swebench"]
    assert environment_factory("python_tasks") == "canopy.envs.python_tasks:PythonTaskEnvironment"
    appworld = config("env=appworld", "engine=sglang")
    assert (appworld.env.name, appworld.env.pool.workers, appworld.engine.name) == ("appworld", 64, "sglang")
    assert config("env=python_tasks").env.name == config("env.name=python_tasks").env.name == "python_tasks"
    with pytest.raises(ConfigError, match="model.family='llama' has no model in this build yet: use one of qwen3"):
        validate(config("model.family=llama"))


def test_model_family_follows_the_tiny_model_and_must_match_the_checkpoint(tiny_path):
    assert config().model.family == "qwen3" and config("model.tiny.family=qwen3_5").model.family == "qwen3_5"
    assert "tiny-qwen3_5-" in config("model.tiny.family=qwen3_5").model.tiny.dir
    validate(config(f"model.path={tiny_path}"))
    with pytest.raises(ConfigError, match=r"model.family=qwen3_5 but model.path .* holds model_type='qwen3': set "):
        validate(config(f"model.path={tiny_path}", "model.family=qwen3_5"))
    assert config("experiment=swebench_canopy", "model.path=/m").model.family == "qwen3_5"


def test_chat_template_options_come_from_the_experiment(tiny_path):
    from canopy.build import build_tokenizer

    assert build_tokenizer(config(), tiny_path).template_kwargs == {}
    swebench = config("experiment=swebench_canopy", f"model.path={tiny_path}")
    tokenizer = build_tokenizer(swebench, tiny_path)
    assert tokenizer.template_kwargs == {"enable_thinking": False}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_no_std_reaches_the_data_modules_advantages(tiny_path):
    from canopy.build import build_datamodule

    assert build_datamodule(config("ablation=no_std"), tiny_path).algorithm.advantage_std is False
    assert build_datamodule(config(), tiny_path).algorithm.advantage_std is True


@pytest.mark.parametrize("value,shown", [("abc", "'abc'"), ("2.5", "2.5"), ("true", "True")])
def test_a_group_size_that_is_not_an_integer_is_named_as_such(value, shown):
    with pytest.raises(ConfigError) as error:
        validate(config(f"algorithm.group_size={value}"))
    assert str(error.value) == (
        f"algorithm.group_size={shown} must be an integer >= 2 or auto (per-task sizes, algorithm.adaptive_group)"
    )


@pytest.mark.parametrize(
    "gpus,example",
    [
        (["trainer.devices=3"], "parallelism.dp_shard=3"),
        (["trainer.devices=3", "parallelism.tp=2"], "parallelism.dp_shard=3 parallelism.tp=1"),
        (
            ["trainer.devices=4", "trainer.num_nodes=2", "parallelism.tp=2"],
            "parallelism.dp_replicate=2 parallelism.dp_shard=2",
        ),
    ],
)
def test_a_layout_that_misses_the_gpus_is_shown_one_for_the_runs_own(gpus, example):
    """The example in the refusal is for the run's trainer.devices and num_nodes, and applied it validates."""
    with pytest.raises(ConfigError, match="must equal trainer.devices") as error:
        validate(config(*gpus))
    assert str(error.value).split("`")[1] == example
    validate(config(*gpus, *example.split()))


def test_model_path_at_a_file_or_a_training_checkpoint_says_what_it_is(tmp_path):
    """A file is not "missing"; a Lightning checkpoint given as the model is pointed to checkpoint.resume, which
    then validates (the embedded tiny model its base)."""
    torch.save({"state_dict": {}}, tmp_path / "last.ckpt")
    with pytest.raises(ConfigError) as error:
        validate(config("model.path=README.md"))
    assert str(error.value) == (
        "model.path 'README.md' is a file: point it at an HF checkpoint directory (config.json + *.safetensors + "
        "tokenizer)"
    )
    ckpt = tmp_path / "last.ckpt"
    with pytest.raises(ConfigError) as error:
        validate(config(f"model.path={ckpt}"))
    assert str(error.value).startswith(f"model.path '{ckpt}' is a Lightning training checkpoint")
    assert f"checkpoint.resume={ckpt} (train.py) or checkpoint={ckpt} (evaluate.py)" in str(error.value)
    validate(config(f"checkpoint.resume={ckpt}"))
