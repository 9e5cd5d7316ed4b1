"""Config schemas and validation: a typo'd or mistyped key fails at composition, every bad value at start, each with
the key named."""

import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from canopy.envs import available, environment_module
from canopy.envs.pool import PoolSettings, check_serving
from canopy.envs.ray_pool import RaySettings
from canopy.envs.sandbox import SandboxLimits
from canopy.errors import ConfigError, is_int, require
from canopy.mismatch import RolloutCorrection
from canopy.models import MODEL_FAMILIES, family_of
from canopy.modules.canopy_module import CP_NEEDS_GPU, CP_SEQ_MEAN  # the module checks them again
from canopy.modules.parallel import ParallelSettings
from canopy.rollout.sglang import SGLangSettings
from canopy.trajectories import sampling_of

ENGINES = ("local", "sglang")
SCHEMAS = (PoolSettings, SandboxLimits, RaySettings, ParallelSettings, RolloutCorrection, SGLangSettings) + tuple(
    settings for name in available() if (settings := getattr(environment_module(name), "SETTINGS", None))
)
"""Components whose settings dataclass is the schema of their config node and holds its only defaults (an
environment's is its module's `SETTINGS`). Each is composed in as `schema@<node>: <Class>` (conf/train.yaml; an
environment's in conf/env/<name>.yaml), the YAML setting only what differs (`python train.py --cfg job` prints
every key)."""


def register_schemas() -> None:
    for schema in SCHEMAS:
        node = OmegaConf.structured(schema)
        for frozen in (node, *(node[key] for key in node if OmegaConf.is_config(node[key]))):
            OmegaConf.set_readonly(frozen, None)  # a frozen settings object; its config node takes the YAML's values
        ConfigStore.instance().store(group="schema", name=schema.__name__, node=node)


register_schemas()  # on import: train.py, evaluate.py and the tools compose after importing this module
CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_config(overrides=(), name: str = "train") -> DictConfig:
    """The config `python <name>.py OVERRIDES` runs with, composed outside Hydra's entry point (tools, tests)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def mean_group_size(cfg: DictConfig) -> int:
    """Rollouts per task on average: `algorithm.group_size`, or with `auto` its `adaptive_group.mean`."""
    a = cfg.algorithm
    return a.adaptive_group.mean if a.group_size == "auto" else a.group_size


def validate(cfg: DictConfig) -> None:
    """Check the keys the recipe depends on; raise ConfigError with the fix on the first bad one."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"config key(s) {missing} must be set, e.g. `python train.py {missing[0]}=...`")
    a, d, b, s, o, t = cfg.algorithm, cfg.data, cfg.budget, cfg.sampling, cfg.optim, cfg.trainer

    require(
        a.group_size == "auto" or (is_int(a.group_size) and a.group_size >= 2),
        f"algorithm.group_size={a.group_size}: group-relative advantages need >= 2 rollouts per task; set "
        "algorithm.group_size >= 2, or auto (Eq. 5 per task, algorithm.adaptive_group)",
    )
    g = a.adaptive_group
    require(
        is_int(g.floor) and is_int(g.cap) and is_int(g.mean) and 2 <= g.floor <= g.mean <= g.cap,
        f"algorithm.adaptive_group floor={g.floor} / mean={g.mean} / cap={g.cap}: need integers with "
        "2 <= floor <= mean <= cap",
    )
    require(0 < g.tau < 1, f"algorithm.adaptive_group.tau={g.tau} must lie strictly between 0 and 1 (Eq. 5)")
    require(0 <= g.decay <= 1, f"algorithm.adaptive_group.decay={g.decay} must lie in [0, 1]")
    require(
        isinstance(a.kl_coef, (int, float)) and a.kl_coef >= 0,
        f"algorithm.kl_coef={a.kl_coef} must be >= 0 (0 disables the KL anchor, the no_kl ablation)",
    )
    require(
        0 <= a.clip_low < 1 and a.clip_high >= 0,
        f"algorithm.clip_low={a.clip_low} / clip_high={a.clip_high}: need 0 <= clip_low < 1 and clip_high >= 0",
    )
    require(
        a.loss_aggregation in ("token-mean", "seq-mean"),
        f"algorithm.loss_aggregation={a.loss_aggregation!r} is unknown: use token-mean (the recipe) or seq-mean",
    )
    require(a.reward in ("sparse", "dense"), f"algorithm.reward={a.reward!r} is unknown: use sparse or dense")
    require(
        isinstance(a.advantage_std, bool),
        f"algorithm.advantage_std={a.advantage_std!r} must be true (Eq. 3 divides by the group's std) or false "
        "(centred only: ablation=no_std)",
    )
    require(a.entropy_coef >= 0, f"algorithm.entropy_coef={a.entropy_coef} must be >= 0 (the recipe uses 0)")
    require(is_int(d.tasks_per_step) and d.tasks_per_step >= 1, f"data.tasks_per_step={d.tasks_per_step} must be >= 1")
    require(
        is_int(a.minibatches_per_step) and 1 <= a.minibatches_per_step <= d.tasks_per_step * mean_group_size(cfg),
        f"algorithm.minibatches_per_step={a.minibatches_per_step}: use 1 (strict on-policy) up to the episodes per "
        "step",
    )
    for key in (
        "max_turns",
        "max_response_tokens",
        "max_prompt_tokens",
        "max_observation_tokens",
        "max_context_tokens",
    ):
        require(is_int(b[key]) and b[key] >= 1, f"budget.{key}={b[key]} must be a positive integer")
    require(
        b.per_turn_generation_cap is None or (is_int(b.per_turn_generation_cap) and b.per_turn_generation_cap >= 1),
        f"budget.per_turn_generation_cap={b.per_turn_generation_cap} must be null (uncapped) or a positive integer",
    )
    require(
        b.max_prompt_tokens < b.max_context_tokens,
        f"budget.max_prompt_tokens={b.max_prompt_tokens} must be below "
        f"budget.max_context_tokens={b.max_context_tokens}",
    )
    require(s.temperature > 0, f"sampling.temperature={s.temperature} must be > 0")
    require(0 < s.top_p <= 1, f"sampling.top_p={s.top_p} must lie in (0, 1]")
    require(is_int(s.top_k) and (s.top_k == -1 or s.top_k >= 1), f"sampling.top_k={s.top_k}: use -1 (off) or >= 1")

    require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    require(o.grad_clip is None or o.grad_clip > 0, f"optim.grad_clip={o.grad_clip} must be null (off) or > 0")
    require(is_int(t.max_steps) and t.max_steps >= 1, f"trainer.max_steps={t.max_steps} must be >= 1")
    require(
        is_int(t.micro_batch_tokens) and t.micro_batch_tokens >= 1,
        f"trainer.micro_batch_tokens={t.micro_batch_tokens} must be a positive integer",
    )

    require(
        is_int(t.logprob_chunk_tokens) and t.logprob_chunk_tokens >= 1,
        f"trainer.logprob_chunk_tokens={t.logprob_chunk_tokens} must be a positive integer (e.g. 2048)",
    )
    require(
        isinstance(t.memory_check, bool),
        f"trainer.memory_check={t.memory_check} must be true (refuse a GPU run that cannot fit) or false",
    )
    require(
        t.gpu_memory_gib is None or (isinstance(t.gpu_memory_gib, (int, float)) and t.gpu_memory_gib > 0),
        f"trainer.gpu_memory_gib={t.gpu_memory_gib} must be null (the device's own) or the GPU's memory in GiB, "
        "e.g. 79.6 for an H100 80 GB",
    )

    p = cfg.parallelism
    for key in ("dp_replicate", "dp_shard", "tp", "cp"):
        require(is_int(p[key]) and p[key] >= 1, f"parallelism.{key}={p[key]} must be a positive integer")
    require(
        is_int(t.rollout_timeout_s) and t.rollout_timeout_s > 0,
        f"trainer.rollout_timeout_s={t.rollout_timeout_s} must be a positive integer: how long the other ranks wait "
        "for rank 0's rollout step or evaluation",
    )
    require(p.cp == 1 or t.accelerator != "cpu", CP_NEEDS_GPU)
    require(p.cp == 1 or a.loss_aggregation == "token-mean", CP_SEQ_MEAN)
    require(
        p.mixed_precision in ("float32", "bfloat16"),
        f"parallelism.mixed_precision={p.mixed_precision!r} is unknown: use float32 or bfloat16",
    )
    require(
        p.activation_checkpointing in ("none", "full", "selective"),
        f"parallelism.activation_checkpointing={p.activation_checkpointing!r} is unknown: use none, full or selective",
    )
    for key in ("devices", "num_nodes"):
        require(is_int(t[key]) and t[key] >= 1, f"trainer.{key}={t[key]} must be a positive integer")
    world = p.dp_replicate * p.dp_shard * p.tp * p.cp
    require(
        world == t.devices * t.num_nodes,
        f"parallelism.dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} x tp={p.tp} x cp={p.cp} = {world} must "
        f"equal trainer.devices={t.devices} x trainer.num_nodes={t.num_nodes}: e.g. `trainer.devices=2 "
        "parallelism.dp_shard=2`, or across nodes `parallelism.dp_replicate=<nodes> parallelism.dp_shard=<devices>`",
    )
    require(
        p.tp * p.cp <= t.devices and t.devices % (p.tp * p.cp) == 0,
        f"parallelism.tp={p.tp} x cp={p.cp} must divide trainer.devices={t.devices}: tensor and context parallel "
        "groups stay inside one node (NVLink); span nodes with dp_shard or dp_replicate",
    )
    resume = cfg.checkpoint.resume
    require(
        resume is None or Path(resume).exists(),
        f"checkpoint.resume '{resume}' does not exist: pass a .ckpt written by checkpoint.every_n_steps (e.g. "
        ".../checkpoints/last.ckpt)",
    )
    require(
        resume is None
        or not Path(resume).is_dir()
        or all((Path(resume) / f).is_file() for f in (".metadata", "meta.pt")),
        f"checkpoint.resume '{resume}' is a sharded checkpoint whose save did not finish (no .metadata or meta.pt): "
        "resume from an earlier complete one, e.g. the previous .../checkpoints/step<N>.ckpt",
    )
    require(
        is_int(cfg.checkpoint.every_n_steps) and cfg.checkpoint.every_n_steps >= 0,
        f"checkpoint.every_n_steps={cfg.checkpoint.every_n_steps} must be 0 (off) or a positive integer",
    )
    environment_module(cfg.env.name)
    check_serving(cfg.env)
    require(cfg.engine.name in ENGINES, f"engine.name={cfg.engine.name!r} is unknown: use one of {', '.join(ENGINES)}")
    require(
        cfg.model.path is not None or bool(cfg.model.tiny),
        "model.path is not set: pass model.path=/path/to/hf_checkpoint (config.json + *.safetensors + tokenizer)",
    )
    require(
        cfg.model.path is None or Path(cfg.model.path).is_dir(),
        f"model.path '{cfg.model.path}' does not exist: point it at an HF checkpoint directory (config.json + "
        "*.safetensors + tokenizer)"
        + (", or leave model.path unset for the embedded tiny model" if cfg.model.tiny else ""),
    )
    require(
        cfg.model.path is None or (Path(cfg.model.path) / "config.json").is_file(),
        f"model.path '{cfg.model.path}' has no config.json: point it at an HF checkpoint directory (config.json + "
        "*.safetensors + tokenizer)",
    )
    require(
        cfg.model.family in MODEL_FAMILIES,
        f"model.family={cfg.model.family!r} has no model in this build yet: use one of {', '.join(MODEL_FAMILIES)}",
    )
    if cfg.model.path is not None:
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
        family = family_of(hf)
        declared, found = hf.get("model_type"), family.name if family is not None else None
        require(
            found == cfg.model.family,
            f"model.family={cfg.model.family} but model.path '{cfg.model.path}' holds model_type={declared!r}"
            + (f": set model.family={found}" if found else f": Canopy trains {', '.join(MODEL_FAMILIES)}"),
        )
    if cfg.get("trajectories") is not None:
        sampling_of(cfg.trajectories)
    if cfg.engine.name == "sglang":
        SGLangSettings(**cfg.engine.sglang).validate(cfg.trainer.accelerator, cfg.trainer.devices)
    if cfg.engine.name == "local":
        require(
            cfg.engine.dtype in ("float32", "bfloat16", "float16"),
            f"engine.dtype={cfg.engine.dtype!r} is unknown: use float32, bfloat16 or float16",
        )
        require(
            cfg.engine.device in ("cpu", "cuda") or str(cfg.engine.device).startswith("cuda:"),
            f"engine.device={cfg.engine.device!r} is unknown: use cpu, cuda or cuda:N",
        )
        require(
            is_int(cfg.engine.session_tokens) and cfg.engine.session_tokens >= 0,
            f"engine.session_tokens={cfg.engine.session_tokens!r} must be an integer >= 0 (0: no sessions kept)",
        )


def validate_eval(cfg: DictConfig) -> None:
    """The keys evaluate.py adds (conf/evaluate.yaml), after `validate`."""
    require(is_int(cfg.k) and cfg.k >= 1, f"k={cfg.k} must be a positive integer (runs per task for mean@k / best@k)")
    require(0 < cfg.tau < 1, f"tau={cfg.tau} must lie strictly between 0 and 1 (target coverage of Eq. 5)")
    require(is_int(cfg.pilot_samples) and cfg.pilot_samples >= 1, f"pilot_samples={cfg.pilot_samples} must be >= 1")
    require(
        cfg.checkpoint is None or Path(cfg.checkpoint).exists(),
        f"checkpoint '{cfg.checkpoint}' does not exist: pass an HF checkpoint directory (e.g. <run dir>/final_hf) "
        "or a .ckpt written by checkpoint.every_n_steps",
    )
    require(
        cfg.transfer_from is None or Path(cfg.transfer_from).is_file(),
        f"transfer_from '{cfg.transfer_from}' does not exist: pass an eval.json written by evaluate.py",
    )
