"""The run's loggers (`conf/logger/`): TensorBoard always (the run's figures and the paper checks read it), and
Weights & Biases or MLflow beside it through Lightning's own loggers, so every metric keeps its name everywhere.
At the end of a run `finish_loggers` gives each what it can hold of the trajectory logs, then closes the W&B run:
W&B a table of the last logged training step's episodes and the viewer page as HTML media; MLflow the viewer page
and each stream's last step file as artifacts."""

from pathlib import Path

from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from omegaconf import DictConfig

from canopy.errors import ConfigError
from canopy.trajectories import read_step, step_files

KNOWN = ("tensorboard", "wandb", "mlflow")
WANDB_MODES = ("online", "offline", "disabled")


def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Logger]:
    """TensorBoard first (`trainer.logger`), then the others `cfg.logger` names."""
    chosen = cfg.get("logger") or {}
    unknown = sorted(set(chosen) - set(KNOWN))
    if unknown:
        choices = ", ".join(KNOWN)
        raise ConfigError(f"logger {unknown} is unknown: pick from conf/logger/ ({choices}), e.g. logger=wandb")
    loggers: list[Logger] = [TensorBoardLogger(run_dir, name="tensorboard", version="")]
    if chosen.get("wandb") is not None:
        w = chosen.wandb
        if w.mode not in WANDB_MODES:
            raise ConfigError(f"logger.wandb.mode={w.mode!r} is unknown: use one of {', '.join(WANDB_MODES)}")
        loggers.append(
            WandbLogger(
                project=w.project,
                name=w.name or run_dir.name,
                entity=w.entity,
                save_dir=str(run_dir),
                mode=w.mode,
                tags=list(w.tags),
            )
        )
    if chosen.get("mlflow") is not None:
        m = chosen.mlflow
        loggers.append(
            MLFlowLogger(
                experiment_name=m.experiment,
                run_name=m.run_name or run_dir.name,
                tracking_uri=m.tracking_uri or f"sqlite:///{run_dir.resolve()}/mlflow.db",
                artifact_location=None if m.tracking_uri else (run_dir / "mlflow_artifacts").resolve().as_uri(),
            )
        )
    return loggers


EPISODE_COLUMNS = ["step", "task_id", "tier", "sample", "outcome", "reward", "advantage", "turns", "last_action"]


def episode_rows(path: Path) -> list[list]:
    """One row per episode of a step file, in `EPISODE_COLUMNS`."""
    rows = []
    for r in read_step(path):
        outcome = r["quarantine"] and "quarantined" or ("success" if r["verdict"]["success"] else "failure")
        last = r["turns"][-1]["action"] if r["turns"] else ""
        rows.append([r["step"], r["task_id"], r["tier"], r["sample_index"], outcome, r["reward"], r["advantage"],
                     r["num_turns"], last[-2000:]])  # fmt: skip
    return rows


def finish_loggers(loggers: list[Logger], run_dir: Path) -> None:
    """Give each logger that holds tables or files the run's episodes (see the module docstring); end the W&B run."""
    page = run_dir / "viewer.html"
    streams = sorted(p.name for p in (run_dir / "trajectories").glob("*") if p.is_dir())
    last = {}  # each stream's last step file
    for stream in streams:
        files = list(step_files(run_dir / "trajectories" / stream).values())
        if files:
            last[stream] = files[-1]
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            import wandb

            if last.get("train"):
                table = wandb.Table(columns=EPISODE_COLUMNS, data=episode_rows(last["train"]))
                logger.experiment.log({"episodes/last_step": table})
            if page.is_file():  # W&B shows HTML media in the run's page
                logger.experiment.log({"episodes/viewer": wandb.Html(page.read_text(encoding="utf-8"), inject=False)})
            logger.experiment.finish()
        elif isinstance(logger, MLFlowLogger):
            client, run_id = logger.experiment, logger.run_id
            if page.is_file():
                client.log_artifact(run_id, str(page))
            for stream, path in last.items():
                client.log_artifact(run_id, str(path), artifact_path=f"trajectories/{stream}")
