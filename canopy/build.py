"""Builds the run's parts from a validated config: tokenizer, environment, engine, budget, data and module."""

import fcntl
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from canopy.compat import require_multiprocess_torch
from canopy.datamodules.rollout import RolloutDataModule
from canopy.envs import environment_factory, environment_kwargs
from canopy.envs.pool import EnvironmentPool, PoolSettings
from canopy.envs.worker import build_environment
from canopy.models import get_family
from canopy.modules.canopy_module import CanopyModule
from canopy.rollout.chat import ChatTokenizer
from canopy.rollout.engine import EngineHandle
from canopy.rollout.local import LocalEngine
from canopy.rollout.settings import EngineSettings
from canopy.rollout.sglang import SGLangEngine
from canopy.rollout.vllm import VLLMEngine
from canopy.tiny_model import build_tiny_checkpoint
from canopy.trajectories import TrajectoryLog, sampling_of


def ensure_model(cfg: DictConfig) -> str:
    """The checkpoint directory: `model.path` as given (validated to exist), else the embedded default's tiny
    random Qwen3, built on first use at its own cache location `model.tiny.dir` and never anywhere else."""
    if cfg.model.path is not None:
        return str(cfg.model.path)
    tiny = OmegaConf.to_container(cfg.model.tiny, resolve=True)
    path = Path(tiny.pop("dir"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the processes of one run (torchrun starts them all at once) build it once
        if not (path / "config.json").is_file():
            build_tiny_checkpoint(path, seed=cfg.seed, **tiny)
    return str(path)


def build_env(cfg: DictConfig, log_dir: str | Path | None = None):
    """The environment `canopy.envs.<env.name>`, its own keys checked here (once: `validate` checks the rest, and the
    entry points build the environment right after it), in-process, or behind a pool of isolated worker
    processes when `env.pool.workers > 0` (keeping the logs of faulted workers and servers in `log_dir`, e.g. the
    run's `env_logs/`); behind such a pool on each node of a Ray cluster when `env.ray.address` is set."""
    kwargs = environment_kwargs(cfg.env)
    factory = environment_factory(cfg.env.name)
    settings: PoolSettings = OmegaConf.to_object(cfg.env.pool)
    if cfg.env.ray.address is not None:
        from canopy.envs.ray_pool import RayEnvironment  # imports ray only when it joins the cluster

        return RayEnvironment(factory, kwargs, settings, OmegaConf.to_object(cfg.env.ray), log_dir=log_dir)
    if settings.workers:
        return EnvironmentPool(factory, kwargs, settings, log_dir=log_dir)
    return build_environment(factory, kwargs)


SERVER_ENGINES = {"sglang": SGLangEngine, "vllm": VLLMEngine}  # HTTP servers: their settings are engine.<name>.*


def build_engine(cfg: DictConfig, model_path: str, tokenizer):
    """`engine.name`'s engine over the checkpoint at `model_path`, stopping at its model family's stop tokens."""
    settings: EngineSettings = OmegaConf.to_object(cfg.engine)
    stop = [tokenizer.convert_tokens_to_ids(token) for token in get_family(cfg.model.family).chat.stop]
    rope_scaling = cfg.budget.rope_scaling and OmegaConf.to_container(cfg.budget.rope_scaling)
    if settings.name == "local":
        return LocalEngine(
            model_path,
            stop_token_ids=stop,
            pad_token_id=tokenizer.pad_token_id,
            seed=cfg.seed,
            rope_scaling=rope_scaling,
            settings=settings.local,
        )
    return SERVER_ENGINES[settings.name](
        model_path,
        stop,
        settings.chosen,
        context_length=cfg.budget.max_context_tokens,
        rope_scaling=rope_scaling,
        seed=cfg.seed,
    )


def build_tokenizer(cfg: DictConfig, model_path: str) -> ChatTokenizer:
    """The checkpoint's tokenizer, its chat template applied with `model.chat_template_kwargs`, with its model
    family's chat markers."""
    kwargs = OmegaConf.to_container(cfg.model.chat_template_kwargs) if cfg.model.get("chat_template_kwargs") else {}
    return ChatTokenizer(AutoTokenizer.from_pretrained(model_path), get_family(cfg.model.family).chat, **kwargs)


def build_trajectory_log(cfg: DictConfig, tokenizer, model_path: str, root: str | Path) -> TrajectoryLog | None:
    """The run's trajectory log under `root` (`trajectories.*`), or None when it is off."""
    sampling = sampling_of(cfg.trajectories) if cfg.get("trajectories") is not None else None
    if sampling is None:
        return None
    return TrajectoryLog(root, tokenizer, model_path, sampling, cfg.algorithm.reward)


def build_engine_handle(cfg: DictConfig, model_path: str) -> EngineHandle:
    """The run's one engine, built (with the tokenizer's stop and pad ids) on first use, by the generating rank
    only (see `EngineHandle`)."""
    return EngineHandle(
        lambda: build_engine(cfg, model_path, AutoTokenizer.from_pretrained(model_path)),
        dtype=OmegaConf.to_object(cfg.engine).compute_dtype(model_path),
    )


def build_datamodule(
    cfg: DictConfig,
    model_path: str,
    engine: EngineHandle | None = None,
    env=None,
    trajectory_dir: str | Path | None = None,
) -> RolloutDataModule:
    """The rollout data module over `env` (the run's environment, from `build_env`; a new one when not given),
    generating with `engine` (the run's handle; a new one when not given), logging its episodes under
    `trajectory_dir` (when given and `trajectories.enabled`)."""
    tokenizer = build_tokenizer(cfg, model_path)
    trajectory_log = build_trajectory_log(cfg, tokenizer, model_path, trajectory_dir) if trajectory_dir else None
    return RolloutDataModule(
        env if env is not None else build_env(cfg),
        engine or build_engine_handle(cfg, model_path),
        tokenizer,
        data=OmegaConf.to_object(cfg.data),
        algorithm=OmegaConf.to_object(cfg.algorithm),
        budget=OmegaConf.to_object(cfg.budget),
        sampling=OmegaConf.to_object(cfg.sampling),
        max_quarantine_fraction=cfg.env.max_quarantine_fraction,
        rollout_timeout_s=cfg.trainer.rollout_timeout_s,
        seed=cfg.seed,
        trajectory_log=trajectory_log,
    )


def build_module(cfg: DictConfig, model_path: str, engine: EngineHandle | None = None) -> CanopyModule:
    """The LightningModule, pushing its weights into `engine` (the handle its data module generates with)."""
    return CanopyModule(
        model_path,
        algorithm=OmegaConf.to_object(cfg.algorithm),
        optim=OmegaConf.to_object(cfg.optim),
        trainer=OmegaConf.to_object(cfg.trainer),
        sampling=OmegaConf.to_object(cfg.sampling),
        parallel=OmegaConf.to_object(cfg.parallelism),
        seed=cfg.seed,
        engine=engine,
    )


def build_strategy(cfg: DictConfig):
    """One process: Lightning's default. Several (on one node or `trainer.num_nodes`): `ModelParallelStrategy`, its
    mesh sized from `parallelism.*` (`validate` checked that it covers devices x nodes)."""
    p = cfg.parallelism
    world = OmegaConf.to_object(p).world
    if world == 1:
        return "auto"
    require_multiprocess_torch(world)
    from lightning.pytorch.strategies import ModelParallelStrategy

    # Lightning's 2-D mesh only has to cover the processes (dp x tp = world); the policy's own meshes are
    # TorchTitan's (canopy.modules.parallel), where CP ranks share their shard's rows and FSDP spans dp_shard x cp
    return ModelParallelStrategy(data_parallel_size=p.dp_replicate * p.dp_shard * p.cp, tensor_parallel_size=p.tp)
