"""Config validation: every bad value fails at start with one line that names the fix."""

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

ENVIRONMENTS = ("embedded", "python_tasks", "appworld", "swebench")
ENGINES = ("local", "sglang")
CP_NEEDS_GPU = (
    "parallelism.cp > 1: context parallel needs GPUs (SDPA has no CPU sharding rule); set trainer.accelerator=gpu "
    "or use parallelism.dp_shard and parallelism.tp"
)
CP_SEQ_MEAN = (
    "algorithm.loss_aggregation=seq-mean with parallelism.cp > 1: per-sequence means need whole sequences on a rank; "
    "use token-mean (the recipe) or parallelism.cp=1"
)


class ConfigError(ValueError):
    """A configuration value Canopy cannot run with; the message says what to change."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(cfg: DictConfig) -> None:
    """Check the keys the recipe depends on; raise ConfigError with the fix on the first bad one."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"config key(s) {missing} must be set, e.g. `python train.py {missing[0]}=...`")
    a, d, b, s, o, t = cfg.algorithm, cfg.data, cfg.budget, cfg.sampling, cfg.optim, cfg.trainer

    _require(
        _is_int(a.group_size) and a.group_size >= 2,
        f"algorithm.group_size={a.group_size}: group-relative advantages need >= 2 rollouts per task; set "
        "algorithm.group_size >= 2",
    )
    _require(
        isinstance(a.kl_coef, (int, float)) and a.kl_coef >= 0,
        f"algorithm.kl_coef={a.kl_coef} must be >= 0 (0 disables the KL anchor, the no_kl ablation)",
    )
    _require(
        0 <= a.clip_low < 1 and a.clip_high >= 0,
        f"algorithm.clip_low={a.clip_low} / clip_high={a.clip_high}: need 0 <= clip_low < 1 and clip_high >= 0",
    )
    _require(
        a.loss_aggregation in ("token-mean", "seq-mean"),
        f"algorithm.loss_aggregation={a.loss_aggregation!r} is unknown: use token-mean (the recipe) or seq-mean",
    )
    _require(a.reward in ("sparse", "dense"), f"algorithm.reward={a.reward!r} is unknown: use sparse or dense")
    _require(a.entropy_coef >= 0, f"algorithm.entropy_coef={a.entropy_coef} must be >= 0 (the recipe uses 0)")
    _require(
        _is_int(d.tasks_per_step) and d.tasks_per_step >= 1, f"data.tasks_per_step={d.tasks_per_step} must be >= 1"
    )
    _require(
        _is_int(a.minibatches_per_step) and 1 <= a.minibatches_per_step <= d.tasks_per_step * a.group_size,
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
        _require(_is_int(b[key]) and b[key] >= 1, f"budget.{key}={b[key]} must be a positive integer")
    _require(
        b.per_turn_generation_cap is None or (_is_int(b.per_turn_generation_cap) and b.per_turn_generation_cap >= 1),
        f"budget.per_turn_generation_cap={b.per_turn_generation_cap} must be null (uncapped) or a positive integer",
    )
    _require(
        b.max_prompt_tokens < b.max_context_tokens,
        f"budget.max_prompt_tokens={b.max_prompt_tokens} must be below "
        f"budget.max_context_tokens={b.max_context_tokens}",
    )
    _require(s.temperature > 0, f"sampling.temperature={s.temperature} must be > 0")
    _require(0 < s.top_p <= 1, f"sampling.top_p={s.top_p} must lie in (0, 1]")
    _require(_is_int(s.top_k) and (s.top_k == -1 or s.top_k >= 1), f"sampling.top_k={s.top_k}: use -1 (off) or >= 1")

    _require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    _require(o.grad_clip is None or o.grad_clip > 0, f"optim.grad_clip={o.grad_clip} must be null (off) or > 0")
    _require(_is_int(t.max_steps) and t.max_steps >= 1, f"trainer.max_steps={t.max_steps} must be >= 1")
    _require(
        _is_int(t.micro_batch_tokens) and t.micro_batch_tokens >= 1,
        f"trainer.micro_batch_tokens={t.micro_batch_tokens} must be a positive integer",
    )

    p = cfg.parallelism
    for key in ("dp_shard", "tp", "cp"):
        _require(_is_int(p[key]) and p[key] >= 1, f"parallelism.{key}={p[key]} must be a positive integer")
    _require(p.cp == 1 or t.accelerator != "cpu", CP_NEEDS_GPU)
    _require(p.cp == 1 or a.loss_aggregation == "token-mean", CP_SEQ_MEAN)
    _require(
        p.mixed_precision in ("float32", "bfloat16"),
        f"parallelism.mixed_precision={p.mixed_precision!r} is unknown: use float32 or bfloat16",
    )
    _require(
        p.activation_checkpointing in ("none", "full", "selective"),
        f"parallelism.activation_checkpointing={p.activation_checkpointing!r} is unknown: use none, full or selective",
    )
    resume = cfg.checkpoint.resume
    _require(
        resume is None or Path(resume).exists(),
        f"checkpoint.resume '{resume}' does not exist: pass a .ckpt written by checkpoint.every_n_steps (e.g. "
        ".../checkpoints/last.ckpt)",
    )
    _require(
        resume is None
        or not Path(resume).is_dir()
        or all((Path(resume) / f).is_file() for f in (".metadata", "meta.pt")),
        f"checkpoint.resume '{resume}' is a sharded checkpoint whose save did not finish (no .metadata or meta.pt): "
        "resume from an earlier complete one, e.g. the previous .../checkpoints/step<N>.ckpt",
    )
    _require(
        _is_int(cfg.checkpoint.every_n_steps) and cfg.checkpoint.every_n_steps >= 0,
        f"checkpoint.every_n_steps={cfg.checkpoint.every_n_steps} must be 0 (off) or a positive integer",
    )
    _require(
        cfg.env.name in ENVIRONMENTS, f"env.name={cfg.env.name!r} is unknown: use one of {', '.join(ENVIRONMENTS)}"
    )
    _validate_env_serving(cfg.env)
    _require(cfg.engine.name in ENGINES, f"engine.name={cfg.engine.name!r} is unknown: use one of {', '.join(ENGINES)}")
    _require(
        cfg.model.path is not None or bool(cfg.model.tiny),
        "model.path is not set: pass model.path=/path/to/hf_checkpoint (config.json + *.safetensors + tokenizer)",
    )
    _require(
        cfg.model.path is None or Path(cfg.model.path).is_dir(),
        f"model.path '{cfg.model.path}' does not exist: point it at an HF checkpoint directory (config.json + "
        "*.safetensors + tokenizer)"
        + (", or leave model.path unset for the embedded tiny model" if cfg.model.tiny else ""),
    )
    _require(
        cfg.model.path is None or (Path(cfg.model.path) / "config.json").is_file(),
        f"model.path '{cfg.model.path}' has no config.json: point it at an HF checkpoint directory (config.json + "
        "*.safetensors + tokenizer)",
    )
    if cfg.env.name == "appworld":
        _validate_appworld(cfg.env.appworld, cfg.env.pool)
    if cfg.engine.name == "sglang":
        _validate_sglang(cfg.engine.sglang, cfg.trainer.accelerator)


def _validate_env_serving(env: DictConfig) -> None:
    pool, sandbox = env.pool, env.sandbox
    _require(
        isinstance(env.max_quarantine_fraction, (int, float)) and 0 < env.max_quarantine_fraction <= 1,
        f"env.max_quarantine_fraction={env.max_quarantine_fraction} must lie in (0, 1]: above this fraction of "
        "quarantined "
        "episodes a step stops the run as a broken setup (1 = only when every episode is)",
    )
    _require(
        _is_int(pool.workers) and pool.workers >= 0,
        f"env.pool.workers={pool.workers} must be 0 (in-process environment) or the number of worker processes",
    )
    for key in ("request_timeout_s", "health_timeout_s", "start_timeout_s", "memory_mb", "max_episodes_per_worker"):
        _require(pool[key] > 0, f"env.pool.{key}={pool[key]} must be > 0")
    for key in ("cpu_seconds", "wall_seconds", "memory_mb", "max_processes", "max_file_mb", "max_output_chars"):
        _require(sandbox[key] > 0, f"env.sandbox.{key}={sandbox[key]} must be > 0")
    _require(
        pool.request_timeout_s > sandbox.wall_seconds + 5,
        f"env.pool.request_timeout_s={pool.request_timeout_s} must exceed "
        f"env.sandbox.wall_seconds={sandbox.wall_seconds} "
        "by > 5 s, or the agent's slow code would be blamed on the worker",
    )
    _require(
        pool.memory_mb > sandbox.memory_mb,
        f"env.pool.memory_mb={pool.memory_mb} must exceed env.sandbox.memory_mb={sandbox.memory_mb}: the worker "
        "hosts the sandbox",
    )


def _validate_appworld(aw: DictConfig, pool: DictConfig) -> None:
    """`env.appworld.*`: the AppWorld venv, the data root, and timeouts nested inside the pool's."""
    _require(
        pool.workers >= 1,
        f"env.pool.workers={pool.workers}: AppWorld holds one world per process, so it runs behind the pool; set "
        "env.pool.workers >= 1 (e.g. 64)",
    )
    _require(
        aw.python is not None and Path(aw.python).is_file(),
        f"env.appworld.python '{aw.python}' not found: run `make appworld` (or point env.appworld.python / "
        "CANOPY_APPWORLD_PYTHON at AppWorld's venv python)",
    )
    _require(
        aw.root is not None and (Path(aw.root) / "data" / "tasks").is_dir(),
        f"env.appworld.root '{aw.root}' has no data/tasks: download the data (`appworld download data --root DIR`, "
        "README) "
        "and pass env.appworld.root=DIR (or export APPWORLD_ROOT)",
    )
    for key in ("cell_timeout_s", "request_timeout_s", "start_timeout_s", "max_observation_chars"):
        _require(aw[key] > 0, f"env.appworld.{key}={aw[key]} must be > 0")
    slowest = max(aw.cell_timeout_s + 15, aw.start_timeout_s) + aw.request_timeout_s
    _require(
        pool.request_timeout_s > slowest,
        f"env.pool.request_timeout_s={pool.request_timeout_s} must exceed {slowest} s (a step runs a cell, or a "
        "start boots a "
        "server, then one more AppWorld request), or the agent's slow code would be blamed on the worker",
    )


def _validate_sglang(s: DictConfig, accelerator: str) -> None:
    """`engine.sglang.*`: launch (python) or attach (urls), ports, sizes, weight sync and request limits."""
    urls = list(s.urls or [])
    _require(
        bool(urls) or bool(s.python),
        "engine.sglang.python is not set: point it at the SGLang venv's python (or export CANOPY_SGLANG_PYTHON), "
        "or attach to running servers with engine.sglang.urls=[http://host:port]",
    )
    _require(
        all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls),
        f"engine.sglang.urls={urls}: each must be a server URL like http://host:30000",
    )
    for key in ("num_servers", "tp_size", "concurrency", "base_port", "sync_master_port"):
        _require(_is_int(s[key]) and s[key] >= 1, f"engine.sglang.{key}={s[key]} must be a positive integer")
    _require(_is_int(s.base_gpu_id) and s.base_gpu_id >= 0, f"engine.sglang.base_gpu_id={s.base_gpu_id} must be >= 0")
    _require(
        isinstance(s.mem_fraction, (int, float)) and 0 < s.mem_fraction < 1,
        f"engine.sglang.mem_fraction={s.mem_fraction} must lie in (0, 1), e.g. 0.8",
    )
    _require(
        s.weight_sync in ("disk", "distributed"),
        f"engine.sglang.weight_sync={s.weight_sync!r} is unknown: use disk or distributed",
    )
    _require(
        s.sync_backend in ("nccl", "gloo"),
        f"engine.sglang.sync_backend={s.sync_backend!r} is unknown: use nccl or gloo",
    )
    _require(
        not (s.weight_sync == "distributed" and s.sync_backend == "nccl" and accelerator == "cpu"),
        "engine.sglang.weight_sync=distributed over nccl broadcasts from the trainer's GPU: set "
        "trainer.accelerator=gpu, "
        "or use engine.sglang.weight_sync=disk",
    )
    _require(s.sync_dir is not None, "engine.sglang.sync_dir is not set: give a directory the servers can read")
    for key in ("request_timeout_s", "startup_timeout_s"):
        _require(isinstance(s[key], (int, float)) and s[key] > 0, f"engine.sglang.{key}={s[key]} must be > 0 seconds")
    _require(_is_int(s.max_retries) and s.max_retries >= 0, f"engine.sglang.max_retries={s.max_retries} must be >= 0")


def validate_eval(cfg: DictConfig) -> None:
    """The keys evaluate.py adds (conf/evaluate.yaml), after `validate`."""
    _require(_is_int(cfg.k) and cfg.k >= 1, f"k={cfg.k} must be a positive integer (runs per task for mean@k / best@k)")
    _require(0 < cfg.tau < 1, f"tau={cfg.tau} must lie strictly between 0 and 1 (target coverage of Eq. 5)")
    _require(_is_int(cfg.pilot_samples) and cfg.pilot_samples >= 1, f"pilot_samples={cfg.pilot_samples} must be >= 1")
    _require(
        cfg.checkpoint is None or Path(cfg.checkpoint).exists(),
        f"checkpoint '{cfg.checkpoint}' does not exist: pass an HF checkpoint directory (e.g. <run dir>/final_hf) "
        "or a .ckpt written by checkpoint.every_n_steps",
    )
    _require(
        cfg.transfer_from is None or Path(cfg.transfer_from).is_file(),
        f"transfer_from '{cfg.transfer_from}' does not exist: pass an eval.json written by evaluate.py",
    )
