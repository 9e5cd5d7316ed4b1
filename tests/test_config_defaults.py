"""Defaults written once: a component's settings dataclass is the schema and the only default of its config node,
and every other default conf/train.yaml shows is the one the code would use without it (issue 31)."""

import dataclasses
import inspect
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from canopy.build import build_env, build_module
from canopy.config import SCHEMAS, SECTIONS, compose_config, validate
from canopy.datamodules.rollout import RolloutDataModule
from canopy.envs.appworld import environment_kwargs as appworld_kwargs
from canopy.errors import ConfigError
from canopy.modules.canopy_module import CanopyModule
from canopy.rollout.local import LocalEngine
from canopy.rollout.settings import LocalEngineSettings

CONF = Path(__file__).resolve().parents[1] / "conf"
# components that take a config section's settings whole, by parameter name
TAKERS = {
    CanopyModule: {"algorithm": "algorithm", "optim": "optim", "trainer": "trainer", "sampling": "sampling"},
    RolloutDataModule: {"data": "data", "algorithm": "algorithm", "budget": "budget", "sampling": "sampling"},
}


def config(*overrides):
    return compose_config(overrides)


def leaves(node: DictConfig, prefix: str = ""):
    for key in node:
        value = node._get_node(key)
        path = f"{prefix}{key}"
        if isinstance(value, DictConfig):
            yield from leaves(value, f"{path}.")
        else:
            yield path, OmegaConf.to_container(value) if OmegaConf.is_list(value) else value._value()


def code_default(component, name):
    """`component`'s own default for `name` (a dotted path into nested settings), or None when it takes no such
    argument or requires it."""
    if "." in name:
        head, rest = name.split(".", 1)
        nested = code_default(component, head)
        return code_default(type(nested), rest) if dataclasses.is_dataclass(nested) else None
    if dataclasses.is_dataclass(component):
        field = next((f for f in dataclasses.fields(component) if f.name == name), None)
        if field is None:
            return None
        return field.default_factory() if field.default is dataclasses.MISSING else field.default
    parameter = inspect.signature(component).parameters.get(name)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def test_components_take_their_settings_whole_and_repeat_no_default():
    """The composition root hands each component its sections' settings objects whole (typed by the section's schema),
    and no constructor has a default of its own for a key its settings define: the schema (or conf/train.yaml for the
    sections whose schema holds none) is the one place a default is written."""
    for component, sections in TAKERS.items():
        parameters = inspect.signature(component).parameters
        for name, node in sections.items():
            assert parameters[name].annotation is SECTIONS[node] and parameters[name].default is inspect.Parameter.empty
        keys = {f.name for node in sections.values() for f in dataclasses.fields(SECTIONS[node])}
        defaulted = {name for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
        assert defaulted & keys == set(), f"{component.__name__} repeats the default of {defaulted & keys}"
    local = inspect.signature(LocalEngine).parameters
    assert not {f.name for f in dataclasses.fields(LocalEngineSettings)} & set(local)  # engine.local.*, whole
    assert local["settings"].annotation == LocalEngineSettings | None
    cfg = config("algorithm.kl_coef=0.25", "trainer.micro_batch_tokens=777", "sampling.temperature=0.5")
    module = build_module(cfg, "unused")
    assert module.algorithm == OmegaConf.to_object(cfg.algorithm) and module.algorithm.kl_coef == 0.25
    assert module.batching.micro_batch_tokens == 777 and module.sampling.temperature == 0.5


def schema_nodes(node: DictConfig, prefix: str = ""):
    """(key, dataclass) of each schema-backed node in a composed config."""
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            kind = OmegaConf.get_type(child)
            if kind in SCHEMAS:
                yield f"{prefix}{key}", kind
            else:
                yield from schema_nodes(child, f"{prefix}{key}.")


def test_schema_defaults_are_written_once():
    """Neither train.yaml nor an environment or engine file (each composed right over the schema) sets a schema key to
    its default: such a line would be a second copy, free to drift (what they set differs: an environment variable
    fallback, AppWorld's 64 workers). Experiments and ablations override whatever they follow (swebench_toy puts back
    the memory cap that env/swebench raised), so they may."""
    composed = dict(schema_nodes(config("experiment=appworld_canopy")))
    composed.update(schema_nodes(config("experiment=swebench_canopy")))
    assert set(composed) == {
        "env.pool",
        "env.sandbox",
        "env.ray",
        "env.appworld",
        "env.swebench",
        "parallelism",
        "algorithm.rollout_correction",
        "engine.local",
        "engine.sglang",
        "engine.vllm",
    }
    copies = []
    for path in [CONF / "train.yaml", *sorted(CONF.glob("env/*.yaml")), *sorted(CONF.glob("engine/*.yaml"))]:
        raw = OmegaConf.load(path)
        header = path.read_text().splitlines()[0]
        package = "env." if header == "# @package env" else "engine." if header == "# @package engine" else ""
        for key, shown in leaves(raw, package):
            node = next((n for n in composed if key.startswith(n + ".")), None)
            if node is not None:
                field = key[len(node) + 1 :]
                if code_default(composed[node], field) == shown:
                    copies.append(f"{path.relative_to(CONF)}: {key}={shown!r}")
    assert copies == []


@pytest.mark.parametrize(
    "override,problem",
    [
        ("env.pool.wokers=2", "not in 'PoolSettings'"),
        ("env.sandbox.memory_mb=lots", "converted to Integer"),
        ("algorithm.kl_coeff=0.1", "not in 'AlgorithmSettings'"),
        ("algorithm.adaptive_group.decay=high", "converted to Float"),
        ("optim.lr=fast", "converted to Float"),
        ("trainer.memory_check=maybe", "not a valid bool"),
        ("algorithm.advantage_std=maybe", "not a valid bool"),
        ("trainer.max_steps=1.5", "converted to Integer"),
        ("data.task_per_step=4", "not in 'DataSettings'"),
        ("budget.max_turn=4", "not in 'BudgetSettings'"),
        ("sampling.temperature=hot", "converted to Float"),
        ("eval.enlarged.sampling.top_kk=5", "not in 'SamplingParams'"),
        ("model.famly=qwen3", "not in 'ModelSettings'"),
        ("report.eval_samples=3", "not in 'ReportSettings'"),
        ("trajectories.max_disk_mb=big", "converted to Float"),
    ],
)
def test_a_typo_or_mistyped_schema_key_fails_at_composition(override, problem):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as error:
        config(override)
    assert problem in str(error.value.__cause__)


def test_what_the_code_uses_is_what_the_config_says(tmp_path):
    cfg = config("env=python_tasks", "env.sandbox.cpu_seconds=7", "parallelism.sequence_parallel=false")
    env = build_env(cfg)
    assert dataclasses.asdict(env.limits) == OmegaConf.to_container(cfg.env.sandbox)
    assert dataclasses.asdict(env.limits)["cpu_seconds"] == 7
    pooled = build_env(config("env=python_tasks", "env.pool.workers=2"))
    assert pooled.settings == OmegaConf.to_object(config("env.pool.workers=2").env.pool)
    module = build_module(cfg, "unused")
    assert module.parallel == OmegaConf.to_object(cfg.parallelism) and module.parallel.sequence_parallel is False


def test_appworld_settings_come_from_their_own_config_file(tmp_path, monkeypatch):
    (tmp_path / "data" / "tasks").mkdir(parents=True)
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path))
    monkeypatch.setenv("CANOPY_APPWORLD_PYTHON", str(python))
    cfg = config("env=appworld", "env.appworld.cell_timeout_s=50")
    assert appworld_kwargs(cfg.env) == {
        **dataclasses.asdict(OmegaConf.to_object(cfg.env.appworld)),
        "python": str(python),
        "root": str(tmp_path),
        "cell_timeout_s": 50,
    }
    with pytest.raises(ConfigError, match="env.appworld.python"):
        monkeypatch.setenv("CANOPY_APPWORLD_PYTHON", str(tmp_path / "missing"))
        appworld_kwargs(cfg.env)
    assert "appworld" not in config("env=python_tasks").env  # AppWorld's keys live in conf/env/appworld.yaml


def test_each_section_schema_types_exactly_the_keys_train_yaml_sets():
    """A section typed by a schema holding no defaults (canopy/config.py SECTIONS) gets every value from the YAML:
    none left unset, none the schema does not know (which composition would refuse)."""
    for overrides in ([], ["experiment=appworld_canopy"], ["experiment=swebench_canopy"], ["experiment=testbed"]):
        cfg = config(*overrides)
        assert OmegaConf.missing_keys(cfg) == set()
        for node, schema in SECTIONS.items():
            assert OmegaConf.get_type(cfg[node]) is schema
            assert isinstance(OmegaConf.to_object(cfg[node]), schema)


@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["algorithm.kl_coeff=1"],
            "algorithm.kl_coeff is not a key of AlgorithmSettings: did you mean algorithm.kl_coef",
        ),
        (["env.pool.wokers=3"], "env.pool.wokers is not a key of PoolSettings: did you mean env.pool.workers?"),
        (["algorithm.adaptive_group.flor=3"], "did you mean algorithm.adaptive_group.floor?"),
        (["optim.lr=fast"], "optim.lr: Value 'fast' of type 'str' could not be converted to Float"),
        (["budget=huge"], "Could not find 'budget/huge': use one of embedded, embedded_enlarged, enlarged, swebench"),
        (["seed"], "Error parsing override 'seed': missing EQUAL"),
    ],
)
def test_a_bad_command_line_is_one_line_naming_the_fix(argv, line):
    from canopy.config import check_command_line

    with pytest.raises(ConfigError) as error:
        check_command_line(argv, "train")
    assert line in str(error.value) and "\n" not in str(error.value)
    check_command_line(["--cfg", "job", *argv], "train")  # flags: left to Hydra


def test_train_py_stops_on_a_typo_with_one_line():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "train.py", "algorithm.kl_coeff=0.1"], cwd=CONF.parent, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "config error: algorithm.kl_coeff is not a key of AlgorithmSettings: did you mean algorithm.kl_coef?"
    ]


def test_a_key_added_to_a_schema_node_is_refused_not_ignored():
    """`+algorithm.kl_coeff=...` passes composition (the `+` adds the key); the settings it would silently skip are
    refused at start instead."""
    with pytest.raises(ConfigError, match="algorithm.kl_coeff is not a key of AlgorithmSettings"):
        validate(config("+algorithm.kl_coeff=0.1"))
    with pytest.raises(ConfigError, match="algorithm.adaptive_group.tau is not a key of AdaptiveGroupSettings"):
        validate(config("+algorithm.adaptive_group.tau=0.5"))
    with pytest.raises(ConfigError, match="env.pool.wokers is not a key of PoolSettings"):  # was a TypeError
        validate(config("+env.pool.wokers=2"))
