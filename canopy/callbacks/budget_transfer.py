"""Budget-transfer evaluation (Section 4.3, Fig. 5, Table 3): the current policy evaluated on a held-out
split at the training budget and at the enlarged one, every `every_n_steps` steps and/or at the end.
Periodic evaluations at the training budget give the dev-score curve of Fig. 4."""

import warnings
from pathlib import Path

import lightning as L
from omegaconf import DictConfig, OmegaConf

from canopy.eval.runner import budget_label, evaluation, sample_runs, with_budget, write_results
from canopy.modules.parallel import alone_on_rank0
from canopy.reports.plots import plot_budget_transfer
from canopy.rollout.budget import Budget
from canopy.rollout.engine import SamplingParams


class BudgetTransferEval(L.Callback):
    """Logs `eval/{training,enlarged}_budget/tgc_<all|tierK>` (mean@k TGC); at the end writes
    `budget_transfer.{json,md}` and `fig5_budget_transfer.png` in the run directory.

    `run_config` holds the run's `seed`, `budget` and `sampling`; `enlarged` the enlarged budget's `budget` and
    `sampling`, as Hydra composes them (`budget@eval.enlarged=<conf/budget name>`).
    It evaluates with the run's own engine, lent by the data module, and never builds one: `engine.at_budget`
    gives the engine for each budget (the local engine: itself, or an in-process sibling with YaRN), sampling
    with the run's seed without moving the training sampler. Servers (SGLang, vLLM) launched for the training budget
    cannot serve the enlarged one (YaRN, a longer context): that evaluation waits for the end of training,
    where the engine relaunches its servers at the enlarged budget on the same ports and GPUs, pushes the final
    weights, evaluates, and relaunches them as they were. Attached servers (`engine.<backend>.urls`) are never
    relaunched: the enlarged evaluation is then left to `evaluate.py` on servers launched for it.
    """

    def __init__(
        self,
        run_config: DictConfig,
        enlarged: DictConfig,
        split: str = "dev",
        k: int = 1,
        every_n_steps: int = 0,
        at_end: bool = True,
    ):
        self.configs = {
            "training_budget": OmegaConf.merge(run_config),
            "enlarged_budget": with_budget(run_config, enlarged),
        }
        self.split, self.k, self.every_n_steps, self.at_end = split, k, every_n_steps, at_end
        self.last: tuple[int, list[dict]] = (-1, [])
        self.skipped: set[str] = set()  # roles whose evaluation this engine cannot serve now (said once)
        self.evaluations = 0  # evaluations so far (every rank counts them alike)

    def evaluate(self, trainer, pl_module, final: bool = False) -> list[dict]:
        """Evaluate the current weights at every budget the engine serves (rank 0; with `final`, every budget)."""
        relaunch, weights = (self._needs_relaunch(trainer) if final else None), None
        if relaunch is not None:  # the weights to push into the relaunched servers: a collective when sharded
            relaunch = trainer.strategy.broadcast(relaunch, src=0) if trainer.world_size > 1 else relaunch
            weights = dict(pl_module.iter_hf_weights()) if relaunch else None
        self.evaluations += 1
        results = alone_on_rank0(
            trainer,
            f"canopy/eval/{self.evaluations}",
            "evaluation",
            lambda: self._evaluate_on_rank0(trainer, pl_module, final, weights),
        )
        return results if trainer.is_global_zero else []

    def _evaluate_on_rank0(self, trainer, pl_module, final: bool, weights: dict | None) -> list[dict]:
        """Each budget's evaluation on the run's engine, or (`final`) on servers relaunched for it with `weights`."""
        dm = trainer.datamodule
        tasks = dm.env.tasks(self.split)
        results = []
        for role, cfg in self.configs.items():
            engine = dm.engine.at_budget(cfg.budget.max_context_tokens, _rope(cfg))
            if engine is not None:
                results.append(self._run(engine, dm, tasks, role, cfg, pl_module.weight_version))
            elif final and dm.engine.can_relaunch:
                with dm.engine.relaunched(cfg.budget.max_context_tokens, _rope(cfg)) as engine:
                    engine.update_weights(weights.items(), pl_module.weight_version)
                    results.append(self._run(engine, dm, tasks, role, cfg, pl_module.weight_version))
                dm.engine.update_weights(weights.items(), pl_module.weight_version)
            elif role not in self.skipped:
                self.skipped.add(role)
                relaunchable = dm.engine.can_relaunch
                when = "at the end of training" if not final and relaunchable else "by evaluate.py"
                warnings.warn(
                    f"budget transfer: the engine's servers run the training budget, so the "
                    f"{budget_label(cfg.budget)} evaluation is left {when} (`python evaluate.py "
                    f"budget={cfg.budget.name} checkpoint=<final_hf>` on servers launched for it)",
                    RuntimeWarning,
                    stacklevel=1,
                )
        if trainer.loggers and results:
            logged = {
                f"eval/{r['role']}/tgc_{tier}": row["tgc_mean"] for r in results for tier, row in r["metrics"].items()
            }
            for logger in trainer.loggers:  # TensorBoard, and W&B or MLflow beside it
                logger.log_metrics(logged, step=pl_module.weight_version)
        return results

    def _needs_relaunch(self, trainer) -> bool | None:
        """On rank 0: whether the final evaluation relaunches servers (the other ranks learn it by broadcast)."""
        if not trainer.is_global_zero:
            return False
        engine = trainer.datamodule.engine
        return any(
            engine.at_budget(cfg.budget.max_context_tokens, _rope(cfg)) is None and engine.can_relaunch
            for cfg in self.configs.values()
        )

    def _run(self, engine, dm, tasks, role: str, cfg: DictConfig, step: int) -> dict:
        with engine.evaluation_seed(cfg.seed):  # the same sampling noise at every evaluation
            sampled = sample_runs(
                engine,
                dm.env,
                dm.tokenizer,
                tasks,
                self.k,
                Budget.of(cfg.budget),
                SamplingParams.of(cfg.sampling),
                seed=cfg.seed,
                description=f"eval {cfg.budget.name} step {step}",
                max_quarantine_fraction=dm.max_quarantine_fraction,
                trajectory_log=dm.trajectory_log,
                log_as=(f"eval_{cfg.budget.name}", step),
            )
        return evaluation(
            tasks,
            sampled,
            policy=f"step {step}",
            budget=budget_label(cfg.budget),
            role=role,
            split=self.split,
            k=self.k,
            step=step,
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps and pl_module.weight_version % self.every_n_steps == 0:
            self.last = (pl_module.weight_version, self.evaluate(trainer, pl_module))

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.at_end:
            return
        step, results = self.last
        if step != pl_module.weight_version or len(results) < len(self.configs):
            results = self.evaluate(trainer, pl_module, final=True)
        if results:
            run_dir = Path(trainer.default_root_dir)
            _, md_path = write_results(run_dir, "budget_transfer", results)
            plot_budget_transfer(results, run_dir / "fig5_budget_transfer.png")
            print(f"\nBudget transfer ({self.split}, mean@{self.k}):\n{md_path.read_text()}")


def _rope(cfg: DictConfig) -> dict | None:
    rope = cfg.budget.get("rope_scaling")
    return OmegaConf.to_container(rope) if rope else None
