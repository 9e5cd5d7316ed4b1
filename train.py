"""Train with the CANOPY recipe: `python train.py` (embedded default) or `python train.py experiment=appworld_canopy`."""

import sys
from pathlib import Path

import hydra
import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from canopy.build import build_datamodule, build_module, ensure_model
from canopy.config import ConfigError, validate
from canopy.modules.policy import save_hf_checkpoint
from canopy.report import plot_learning_curve, success_by_tier, write_summary


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        validate(cfg)
        model_path = ensure_model(cfg)
        datamodule = build_datamodule(cfg, model_path)
        module = build_module(cfg, model_path)
    except ConfigError as error:
        sys.exit(f"config error: {error}")
    run_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    print(OmegaConf.to_yaml(cfg, resolve=True))
    L.seed_everything(cfg.seed, workers=True)
    samples = cfg.report.eval_samples_per_task
    base = success_by_tier(datamodule, samples, "evaluating base policy") if samples else None

    logger = TensorBoardLogger(run_dir, name="tensorboard", version="")
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        precision=cfg.trainer.precision,
        max_steps=cfg.trainer.max_steps,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=run_dir,
    )
    trainer.fit(module, datamodule=datamodule)

    final_dir = save_hf_checkpoint(module.policy, module.adapter, datamodule.tokenizer, model_path, run_dir / "final_hf")
    curve = plot_learning_curve(logger.log_dir, run_dir / "learning_curve.png")
    if base is not None:
        final = success_by_tier(datamodule, samples, "evaluating final policy")
        print(f"\nSuccess on the training tasks ({samples} samples per task):\n{write_summary(run_dir, base, final)}")
    print(f"\nfinal policy (HF format): {final_dir}\nlearning curve: {curve}\nTensorBoard: tensorboard --logdir {logger.log_dir}")


if __name__ == "__main__":
    main()
