"""On-policy audit (Section 3.3; docs/on_policy.md): every update is checked before it
is applied, on the engine-trainer gap `mismatch/logprob_gap`, the mean |log pi_theta - log mu| per action token of
the batch it is about to learn from (`canopy.mismatch`). The trainer's own ratio (`actor/pg_clipfrac`,
`actor/ppo_kl`) is 1 by construction with one update per batch and is not what is audited."""

import warnings

import lightning as L

from canopy.errors import ConfigError
from canopy.mismatch import GapBounds, OffPolicyError


class OnPolicyAudit(L.Callback):
    """`bounds` maps the engine's dtype to its `GapBounds` (`engine.gap_bounds`). The first update of a run (fresh or
    resumed), before the policy moved, must agree within `parity`: the engine and the trainer load the same weights.
    Every later update warns above `warn` and stops the run above `stop`: the engine is not sampling from the
    trainer's weights (a stale or partial weight sync). `strict=False` warns instead of stopping."""

    def __init__(self, bounds: dict, strict: bool = True):
        self.table = {dtype: GapBounds(**values) for dtype, values in bounds.items()}
        for dtype, gap_bounds in self.table.items():
            gap_bounds.validate(f"engine.gap_bounds.{dtype}")
        self.strict = strict
        self.dtype, self.bounds, self.updates = None, None, 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.dtype = pl_module.engine.dtype
        if self.dtype is None:
            raise ConfigError(
                "the on-policy audit needs the engine's dtype: build its handle as EngineHandle(..., dtype=)"
            )
        if self.dtype not in self.table:
            raise ConfigError(
                f"engine.gap_bounds has no bounds for an engine computing in {self.dtype}: add engine.gap_bounds."
                f"{self.dtype}={{parity: ..., warn: ..., stop: ...}} (docs/on_policy.md)"
            )
        self.bounds = self.table[self.dtype]

    def on_train_start(self, trainer, pl_module) -> None:
        self.updates = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        gap, b = pl_module.update_stats["mismatch/logprob_gap"], self.bounds
        first, self.updates = self.updates == 0, self.updates + 1
        where = f"update {trainer.global_step} (rollout step {pl_module.weight_version})"
        if first and gap > b.parity:
            self._stop(
                f"{where}: before any update the engine's logprobs of its own samples differ from the trainer's by "
                f"{gap:.3g} per action token, above the parity bound {b.parity:g} for {self.dtype}: engine and trainer "
                "do not compute the same policy; check that both load model.path at the same sampling temperature "
                f"and RoPE settings, and widen engine.gap_bounds.{self.dtype}.parity only if this is {self.dtype} noise"
            )
        elif not first and gap > b.stop:
            self._stop(
                f"{where}: engine-trainer logprob gap {gap:.3g} per action token > stop bound {b.stop:g} for "
                f"{self.dtype}: the engine is not sampling from the weights the trainer learns from (a stale or "
                "partial weight sync; check the engine's log); if this is inference noise, raise "
                f"engine.gap_bounds.{self.dtype}.stop or set algorithm.rollout_correction.mode"
            )
        elif not first and gap > b.warn:
            warnings.warn(
                f"{where}: engine-trainer logprob gap {gap:.3g} per action token > warn bound {b.warn:g} for "
                f"{self.dtype} (stops above {b.stop:g}); watch mismatch/* in TensorBoard",
                RuntimeWarning,
                stacklevel=1,
            )

    def _stop(self, message: str) -> None:
        if self.strict:
            raise OffPolicyError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
