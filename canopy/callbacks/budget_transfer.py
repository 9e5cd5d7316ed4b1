"""Budget-transfer evaluation (Section 4.3, Fig. 5, Table 3): the current policy evaluated on a held-out
split at the training budget and at the enlarged one, every `every_n_steps` steps and/or at the end.
Periodic evaluations at the training budget give the dev-score curve of Fig. 4."""

import json
from pathlib import Path

import lightning as L
from omegaconf import DictConfig, OmegaConf

from canopy.build import build_budget, build_engine, build_sampling
from canopy.eval.runner import budget_label, evaluation, load_budget, sample_runs, with_budget, write_results
from canopy.tools.plots import plot_budget_transfer


class BudgetTransferEval(L.Callback):
    """Logs `eval/{training,enlarged}_budget/tgc_<all|tierK>` (mean@k TGC); at the end writes
    `budget_transfer.{json,md}` and `fig5_budget_transfer.png` in the run directory.

    `run_config` holds the run's `engine`, `seed`, `budget` and `sampling`; `enlarged_budget` names a
    `conf/budget/` file. Each budget gets its own engine (built once, with that budget's RoPE scaling), so
    evaluation never advances the training engine's sampler.
    """

    def __init__(
        self,
        run_config: DictConfig,
        enlarged_budget: str = "enlarged",
        split: str = "dev",
        k: int = 1,
        every_n_steps: int = 0,
        at_end: bool = True,
    ):
        enlarged = with_budget(run_config, load_budget(enlarged_budget))
        self.configs = {"training_budget": OmegaConf.merge(run_config), "enlarged_budget": enlarged}
        self.split, self.k, self.every_n_steps, self.at_end = split, k, every_n_steps, at_end
        self.engines: dict[str, object] = {}
        self.last: tuple[int, list[dict]] = (-1, [])

    def _engine(self, cfg: DictConfig, model_path: str, tokenizer):
        key = json.dumps(OmegaConf.to_container(cfg.budget).get("rope_scaling"), sort_keys=True)
        if key not in self.engines:
            self.engines[key] = build_engine(cfg, model_path, tokenizer)
        return self.engines[key]

    def evaluate(self, trainer, pl_module) -> list[dict]:
        """Evaluate the current weights at every budget (rank 0; the others only join the weight gathering)."""
        weights = pl_module.iter_hf_weights()  # a collective when sharded
        if not trainer.is_global_zero:
            for _ in weights:
                pass
            return []
        weights = dict(weights)
        dm = trainer.datamodule
        tasks = dm.env.tasks(self.split)
        results = []
        for role, cfg in self.configs.items():
            engine = self._engine(cfg, pl_module.hparams.model_path, dm.tokenizer)
            engine.update_weights(weights.items(), pl_module.weight_version)
            if hasattr(engine, "generator"):
                engine.generator.manual_seed(cfg.seed)  # same sampling noise at every evaluation
            runs, quarantined = sample_runs(
                engine,
                dm.env,
                dm.tokenizer,
                tasks,
                self.k,
                build_budget(cfg),
                build_sampling(cfg),
                seed=cfg.seed,
                description=f"eval {cfg.budget.name} step {trainer.global_step}",
                max_quarantine_fraction=dm.max_quarantine_fraction,
            )
            results.append(
                evaluation(
                    tasks,
                    runs,
                    quarantined,
                    policy=f"step {trainer.global_step}",
                    budget=budget_label(cfg.budget),
                    role=role,
                    split=self.split,
                    k=self.k,
                    step=trainer.global_step,
                )
            )
        if trainer.logger is not None:
            logged = {
                f"eval/{r['role']}/tgc_{tier}": row["tgc_mean"] for r in results for tier, row in r["metrics"].items()
            }
            trainer.logger.log_metrics(logged, step=trainer.global_step)
        return results

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self.last = (trainer.global_step, self.evaluate(trainer, pl_module))

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.at_end:
            return
        step, results = self.last
        if step != trainer.global_step:
            results = self.evaluate(trainer, pl_module)
        if results:
            run_dir = Path(trainer.default_root_dir)
            _, md_path = write_results(run_dir, "budget_transfer", results)
            plot_budget_transfer(results, run_dir / "fig5_budget_transfer.png")
            print(f"\nBudget transfer ({self.split}, mean@{self.k}):\n{md_path.read_text()}")
