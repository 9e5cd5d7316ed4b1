"""Train with the CANOPY recipe: `python train.py` (the embedded default) or `experiment=appworld_canopy`."""

import sys
from pathlib import Path

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig, OmegaConf
from transformers.utils.logging import disable_progress_bar

from canopy.build import (
    build_datamodule,
    build_engine_handle,
    build_env,
    build_module,
    build_strategy,
    ensure_model,
)
from canopy.callbacks import FormatDriftError, RolloutViewer, build_callbacks
from canopy.config import check_command_line, check_context, mean_group_size, validate
from canopy.envs.base import SystemicFaultError
from canopy.errors import ConfigError
from canopy.loggers import build_loggers, finish_loggers
from canopy.memory import check_memory
from canopy.mismatch import OffPolicyError
from canopy.models.hf_checkpoint import write_hf_checkpoint
from canopy.modules.canopy_module import silence_benign_warnings
from canopy.modules.checkpoint import AtomicCheckpoint
from canopy.modules.parallel import end_rank
from canopy.tools.plots import training_plots
from canopy.tools.summary import BaseSuccess, training_task_report, write_summary


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    silence_benign_warnings()
    disable_progress_bar()  # transformers' loading and saving bars: the console shows the run's own
    run_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)
        env = build_env(cfg, log_dir=run_dir / "env_logs")  # checks the environment's own keys; starts nothing yet
        model_path = ensure_model(cfg)
        check_context(cfg, model_path)  # the budgets fit the model's positions (or their YaRN covers them)
        check_memory(cfg, model_path)  # a GPU run that cannot fit stops here, before any rollout
        engine = build_engine_handle(cfg, model_path)  # the run's one engine, lent to the data and the module
        datamodule = build_datamodule(cfg, model_path, engine, env, trajectory_dir=run_dir / "trajectories")
        module = build_module(cfg, model_path, engine)
        strategy = build_strategy(cfg)
        callbacks = build_callbacks(cfg)
        loggers = build_loggers(cfg, run_dir)  # TensorBoard first: the figures read it
    except ConfigError as error:
        sys.exit(f"config error: {error}")
    L.seed_everything(cfg.seed, workers=True)
    updates = module.updates_per_batch  # Lightning counts optimizer steps; the config counts rollout steps
    logger = loggers[0]
    if cfg.checkpoint.every_n_steps:
        callbacks.append(
            AtomicCheckpoint(
                dirpath=run_dir / "checkpoints",
                every_n_train_steps=cfg.checkpoint.every_n_steps * updates,
                save_top_k=-1,
                save_last=True,
                filename="step{step}",
                auto_insert_metric_name=False,
            )
        )
    samples = cfg.report.eval_samples_per_task
    base = BaseSuccess(samples) if samples else None  # the base policy's report, before the first rollout
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        strategy=strategy,
        precision=cfg.trainer.precision,
        max_steps=cfg.trainer.max_steps * updates,
        logger=loggers,
        log_every_n_steps=1,
        enable_checkpointing=bool(cfg.checkpoint.every_n_steps),
        callbacks=([base] if base else []) + callbacks,
        enable_progress_bar=any(isinstance(c, ProgressBar) for c in callbacks),  # callbacks.progress, or none
        enable_model_summary=False,  # the resolved config and the memory plan say what runs
        num_sanity_val_steps=0,
        default_root_dir=run_dir,
    )
    if trainer.is_global_zero:
        resolved = OmegaConf.to_yaml(cfg, resolve=True)  # every key, resolved
        (run_dir / "config.yaml").write_text(resolved)
        if cfg.print_config:
            print(resolved)
        print(f"run folder: {run_dir} (resolved config: config.yaml)", flush=True)
    viewer = next((c for c in callbacks if isinstance(c, RolloutViewer)), None)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.checkpoint.resume)
    except (SystemicFaultError, OffPolicyError, ConfigError, FormatDriftError) as error:
        datamodule.teardown("fit")  # every rank stops; rank 0 says why
        engine.close()
        if isinstance(error, FormatDriftError) and viewer and trainer.is_global_zero:
            viewer.final(run_dir)  # the page its message points at, with the episodes logged up to the stop
        kind = {SystemicFaultError: "environment error", OffPolicyError: "off-policy", FormatDriftError: "format drift"}
        sys.exit(f"{kind.get(type(error), 'config error')}: {error}" if trainer.is_global_zero else 1)

    final_weights = module.iter_hf_weights()  # a collective when sharded: every rank walks it, rank 0 writes it
    if not trainer.is_global_zero:
        for _ in final_weights:
            pass
        return
    final_dir = write_hf_checkpoint(final_weights, model_path, run_dir / "final_hf")
    plots = training_plots(logger.log_dir, run_dir, mean_group_size(cfg))
    if base is not None:
        final = training_task_report(datamodule, samples, "evaluating final policy")
        tables = write_summary(run_dir, base.result, final)
        print(f"\nSuccess on the training tasks ({samples} samples per task):\n{tables}")
    if datamodule.trajectory_log is not None:
        datamodule.trajectory_log.close()  # what the last evaluations queued
    page = viewer.final(run_dir) if viewer else None
    finish_loggers(loggers, run_dir)
    engine.close()
    env.close()  # the final reports reopened the environment's pool: its workers and scratch go
    print(
        f"\nfinal policy (HF format): {final_dir}\nplots: {', '.join(p.name for p in plots)}\nTensorBoard: "
        f"tensorboard --logdir {logger.log_dir}"
    )
    if page:
        print(f"rollout viewer: {page} (open it in a browser; no server needed)")


if __name__ == "__main__":
    try:
        check_command_line(sys.argv[1:], "train")  # a typo'd key or option: one line, before Hydra's report
    except ConfigError as error:
        sys.exit(f"config error: {error}")
    main()
    if torch.distributed.is_initialized():  # one of several processes, its part done
        end_rank()  # without finalization, which a gloo worker thread can abort (its docstring says why)
