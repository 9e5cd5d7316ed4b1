"""Config schemas and validation: a typo'd or mistyped key fails at composition, every bad value at start, each with
the key named."""

import dataclasses
import difflib
import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from canopy.datamodules.rollout import DataSettings
from canopy.envs import built_in, built_in_environments, environment_module
from canopy.envs.pool import PoolSettings
from canopy.envs.ray_pool import RaySettings
from canopy.envs.sandbox import SandboxLimits
from canopy.envs.serving import check_serving
from canopy.errors import ConfigError, is_int, require
from canopy.eval.runner import check_checkpoint
from canopy.eval.settings import EvalSettings
from canopy.mismatch import RolloutCorrection
from canopy.models import MODEL_FAMILIES, ModelSettings
from canopy.models.hf_checkpoint import native_positions
from canopy.modules.canopy_module import (  # the module checks CP_* again
    CP_NEEDS_GPU,
    CP_SEQ_MEAN,
    AlgorithmSettings,
    OptimSettings,
    TrainerSettings,
)
from canopy.modules.checkpoint import checkpoint_kind
from canopy.modules.parallel import ParallelSettings
from canopy.reports.summary import ReportSettings
from canopy.rollout.budget import BudgetSettings
from canopy.rollout.engine import SamplingParams
from canopy.rollout.settings import EngineSettings, LocalEngineSettings
from canopy.rollout.sglang.settings import SGLangSettings
from canopy.rollout.vllm.settings import VLLMSettings
from canopy.tiny_model import TINY_TOKENIZERS
from canopy.trajectories import TrajectorySettings

SCHEMAS = (
    PoolSettings,
    SandboxLimits,
    RaySettings,
    ParallelSettings,
    RolloutCorrection,
    LocalEngineSettings,
    SGLangSettings,
    VLLMSettings,
) + tuple(settings for env in built_in_environments().values() if (settings := getattr(env, "SETTINGS", None)))
"""Components whose settings dataclass is the schema of their config node and holds its only defaults (an
environment's is its module's `SETTINGS`). Each is composed in as `schema@<node>: <Class>` (conf/train.yaml; an
environment's in conf/env/<name>.yaml), the YAML setting only what differs (`python train.py --cfg job` prints
every key)."""
SECTIONS = {
    "algorithm": AlgorithmSettings,
    "data": DataSettings,
    "budget": BudgetSettings,
    "sampling": SamplingParams,
    "engine": EngineSettings,
    "optim": OptimSettings,
    "trainer": TrainerSettings,
    "parallelism": ParallelSettings,
    "eval": EvalSettings,
    "report": ReportSettings,
    "model": ModelSettings,
    "trajectories": TrajectorySettings,
}
"""The run's sections typed by a schema whose defaults are conf/train.yaml's (the dataclass holds none, the YAML
says what each key means), or, for `parallelism`, by a schema above. Composed in as `schema@<node>: <Class>`; each
checks its own keys in its `validate`."""


def register_schemas() -> None:
    for schema in {*SCHEMAS, *SECTIONS.values()}:
        node = OmegaConf.structured(schema)
        thaw(node)
        ConfigStore.instance().store(group="schema", name=schema.__name__, node=node)


def thaw(node) -> None:
    """A frozen settings dataclass gives a read-only node; its config node takes the YAML's values."""
    OmegaConf.set_readonly(node, None)
    if OmegaConf.is_dict(node):
        for key in node:
            if OmegaConf.is_config(child := node._get_node(key)):
                thaw(child)


register_schemas()  # on import: train.py, evaluate.py and the tools compose after importing this module
CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_config(overrides=(), name: str = "train") -> DictConfig:
    """The config `python <name>.py OVERRIDES` runs with, composed outside Hydra's entry point (tools, tests)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def check_command_line(argv: list[str], name: str) -> None:
    """Compose the config of `python <name>.py ARGV` before Hydra does, so that a typo'd or mistyped key, or an
    unknown group option, stops the run with one line naming the fix (Hydra's own report spans five or more). A
    command line with flags (`--cfg job`, `-m` sweeps) is left to Hydra."""
    if any(arg.startswith("-") for arg in argv):
        return
    try:
        compose_config(argv, name)
    except (HydraException, OmegaConfBaseException) as error:
        for env in set(built_in()) - set(built_in_environments()):  # a module of canopy/envs/ that does not import
            if f"env/{env}" in str(error):
                environment_module(env)  # raises the line naming what to install
        raise ConfigError(composition_error(error, name)) from error


def composition_error(error: Exception, name: str) -> str:
    """One line from Hydra's or OmegaConf's multi-line composition error, naming the key and the fix."""
    cause = error.__cause__ if isinstance(error.__cause__, OmegaConfBaseException) else error
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        key, schema = cause.full_key, cause.object_type
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and dataclasses.is_dataclass(schema):
            known = [f.name for f in dataclasses.fields(schema)]
            node, _, typo = key.rpartition(".")
            close = difflib.get_close_matches(typo, known, n=1)
            hint = f"did you mean {node}.{close[0]}?" if close else f"its keys are {', '.join(known)}"
            return f"{key} is not a key of {schema.__name__}: {hint}"
        first = str(cause).splitlines()[0]
        return f"{key}: {first}; `python {name}.py --cfg job` prints every key with its value"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if any(line.startswith("Available options") for line in lines):  # an unknown option of a config group
        start = next(i for i, line in enumerate(lines) if line.startswith("Available options")) + 1
        end = next((i for i, line in enumerate(lines) if line.startswith("Config search path")), len(lines))
        return f"{lines[0]}: use one of {', '.join(lines[start:end])}"
    if isinstance(error, OverrideParseException):  # its second line says what is wrong: "missing EQUAL at '<EOF>'"
        return (
            f"{lines[0]}: {lines[1]}; overrides are key=value (https://hydra.cc/docs/advanced/override_grammar/basic)"
        )
    return lines[0]


def mean_group_size(cfg: DictConfig) -> int:
    """Rollouts per task on average: `algorithm.group_size`, or with `auto` its `adaptive_group.mean`."""
    return settings(cfg, "algorithm").mean_group_size()


def settings(cfg: DictConfig, node: str):
    """The settings object of config node `node`, built from its (schema-typed) config."""
    return OmegaConf.to_object(cfg[node])


def unknown_keys(node: DictConfig, prefix: str = ""):
    """Keys under a schema-typed node that its schema does not know: `+node.key=...` adds them past composition,
    and a settings object built from the node would ignore them, or fail on them with a TypeError."""
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node:
        if known is not None and key not in known:
            yield f"{prefix}{key} is not a key of {schema.__name__}"
        elif OmegaConf.is_dict(child := node._get_node(key)) and not child._is_none() and not child._is_missing():
            yield from unknown_keys(child, f"{prefix}{key}.")


def layout_example(t, p) -> str:
    """Overrides that make parallelism's product the run's GPUs (trainer.devices x num_nodes): dp_shard over a
    node's GPUs, dp_replicate over the nodes, tp and cp kept where they divide a node's GPUs."""
    tp, cp = (p.tp, p.cp) if t.devices % (p.tp * p.cp) == 0 else (1, 1)
    target = {"dp_replicate": t.num_nodes, "dp_shard": t.devices // (tp * cp), "tp": tp, "cp": cp}
    return " ".join(f"parallelism.{key}={value}" for key, value in target.items() if p[key] != value)


def validate(cfg: DictConfig) -> None:
    """Check the run's config; raise ConfigError with the fix on the first bad value. Each component's settings
    check their own keys (`validate` beside their fields); the checks that span components are here."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"config key(s) {missing} must be set, e.g. `python train.py {missing[0]}=...`")
    unknown = sorted(unknown_keys(cfg))
    require(not unknown, f"{'; '.join(unknown)}: remove it, or fix its name (`python train.py --cfg job` lists keys)")
    require(is_int(cfg.seed), f"seed={cfg.seed!r} must be an integer")
    require(isinstance(cfg.print_config, bool), f"print_config={cfg.print_config!r} must be true or false")
    for node in [node for node in SECTIONS if node not in ("model", "engine")]:  # the model's files: read last
        settings(cfg, node).validate()
    a, t, p = cfg.algorithm, cfg.trainer, cfg.parallelism

    require(
        a.minibatches_per_step <= cfg.data.tasks_per_step * mean_group_size(cfg),
        f"algorithm.minibatches_per_step={a.minibatches_per_step}: use 1 (strict on-policy) up to the episodes per "
        "step",
    )
    require(p.cp == 1 or t.accelerator != "cpu", CP_NEEDS_GPU)
    require(p.cp == 1 or a.loss_aggregation == "token-mean", CP_SEQ_MEAN)
    world = settings(cfg, "parallelism").world
    require(
        world == t.devices * t.num_nodes,
        f"parallelism.dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} x tp={p.tp} x cp={p.cp} = {world} must "
        f"equal trainer.devices={t.devices} x trainer.num_nodes={t.num_nodes}: e.g. `{layout_example(t, p)}` for "
        "these GPUs (dp_shard over a node's GPUs, dp_replicate over the nodes), or set trainer.devices to match",
    )
    require(
        p.tp * p.cp <= t.devices and t.devices % (p.tp * p.cp) == 0,
        f"parallelism.tp={p.tp} x cp={p.cp} must divide trainer.devices={t.devices}: tensor and context parallel "
        "groups stay inside one node (NVLink); span nodes with dp_shard or dp_replicate",
    )
    if cfg.checkpoint.resume is not None:
        check_resume(cfg.checkpoint.resume)
    require(
        is_int(cfg.checkpoint.every_n_steps) and cfg.checkpoint.every_n_steps >= 0,
        f"checkpoint.every_n_steps={cfg.checkpoint.every_n_steps} must be 0 (off) or a positive integer",
    )
    environment_module(cfg.env.name, cfg.env.requires)
    check_serving(cfg.env)
    path = cfg.model.path
    kind = checkpoint_kind(path) if path is not None else None
    require(
        kind not in ("ckpt", "sharded"),
        f"model.path '{path}' is a Lightning training checkpoint, not an HF model directory: set model.path to its "
        f"run's base model and pass it as checkpoint.resume={path} (train.py)"
        + (f" or checkpoint={path} (evaluate.py)" if kind == "ckpt" else "; evaluate.py takes the run's final_hf"),
    )
    settings(cfg, "model").validate()
    tokenizer = (cfg.model.tiny or {}).get("tokenizer", "word")
    require(
        cfg.model.path is not None or tokenizer in TINY_TOKENIZERS,
        f"model.tiny.tokenizer={tokenizer!r} is unknown: use {' or '.join(TINY_TOKENIZERS)} (byte reads any text)",
    )
    MODEL_FAMILIES[cfg.model.family].require_context_parallel(p.cp)
    settings(cfg, "engine").validate(t.accelerator, t.devices)
    if cfg.engine.name == "vllm":
        require(
            cfg.sampling.top_k == -1 and cfg.sampling.top_p == 1.0,
            f"engine.name=vllm trains on vLLM's logprobs, which with top_k={cfg.sampling.top_k} / "
            f"top_p={cfg.sampling.top_p} are the filtered distribution's, not the one the trainer scores: set "
            "sampling.top_k=-1 sampling.top_p=1.0 for training (evaluation budgets may filter)",
        )


def check_context(cfg: DictConfig, model_path: str, training: bool = True) -> None:
    """The run's budget fits the model at `model_path` (`BudgetSettings.check_context`), and in training so does the
    enlarged budget that the budget-transfer callback evaluates at: refused at start, not after the training."""
    native = native_positions(model_path)
    settings(cfg, "budget").check_context(native)
    if training and cfg.callbacks.get("budget_transfer") is not None:
        OmegaConf.to_object(cfg.eval.enlarged.budget).check_context(native, "eval.enlarged.budget")


def validate_eval(cfg: DictConfig) -> None:
    """The keys evaluate.py adds (conf/evaluate.yaml), after `validate`."""
    require(is_int(cfg.k) and cfg.k >= 1, f"k={cfg.k} must be a positive integer (runs per task for mean@k / best@k)")
    require(0 < cfg.tau < 1, f"tau={cfg.tau} must lie strictly between 0 and 1 (target coverage of Eq. 5)")
    require(is_int(cfg.pilot_samples) and cfg.pilot_samples >= 1, f"pilot_samples={cfg.pilot_samples} must be >= 1")
    if cfg.checkpoint is not None:
        check_checkpoint(cfg.checkpoint)
    if cfg.transfer_from is not None:
        check_transfer_from(cfg.transfer_from)


def check_resume(path: str) -> None:
    """`checkpoint.resume` is a checkpoint train.py can resume: a Lightning .ckpt or a finished sharded one."""
    fix = "pass a checkpoint written by checkpoint.every_n_steps (e.g. <run dir>/checkpoints/last.ckpt)"
    problems = {  # checkpoint_kind -> what is wrong with it, and the fix
        "missing": f"does not exist: {fix}",
        "hf": "is an HF model export (weights only: no optimizer, sampler or step to resume): start a new run from "
        f"its weights with model.path={path}",
        "unfinished": "is a sharded checkpoint whose save did not finish (no .metadata or meta.pt): resume from an "
        "earlier complete one, e.g. the previous <run dir>/checkpoints/step<N>.ckpt",
        "other": "is not a Lightning checkpoint (a .ckpt file, or a sharded checkpoint directory with .metadata and "
        f"meta.pt): {fix}",
    }
    kind = checkpoint_kind(path)
    require(kind in ("ckpt", "sharded"), f"checkpoint.resume '{path}' {problems.get(kind)}")


EVAL_KEYS = {"policy", "budget", "split", "k", "metrics"}  # what Fig. 5 reads of an earlier evaluation


def check_transfer_from(path: str) -> None:
    """`transfer_from` is an eval.json that evaluate.py wrote: a list of records, the first of which Fig. 5 plots."""
    require(Path(path).exists(), f"transfer_from '{path}' does not exist: pass an eval.json written by evaluate.py")
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        records = None
    require(
        isinstance(records, list) and bool(records) and isinstance(records[0], dict) and EVAL_KEYS <= records[0].keys(),
        f"transfer_from '{path}' is not an eval.json written by evaluate.py: pass one, e.g. <eval run dir>/eval.json",
    )
