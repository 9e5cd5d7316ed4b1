"""The run's typed settings as conf/train.yaml composes them, with a test's few values replaced: components take
their settings whole, and a test names only what it changes."""

import dataclasses
import functools

from omegaconf import OmegaConf

from canopy.config import compose_config
from canopy.datamodules.rollout import RolloutDataModule
from canopy.modules.canopy_module import CanopyModule
from canopy.modules.parallel import ParallelSettings
from canopy.rollout.budget import Budget, BudgetSettings


@functools.cache
def _composed():
    return compose_config()


def section(node: str, **values):
    """The settings object of config node `node` (`algorithm`, `data`, ...), with `values` replaced."""
    return dataclasses.replace(OmegaConf.to_object(_composed()[node]), **values)


def split(values: dict, nodes: tuple[str, ...]) -> dict[str, dict]:
    """`values` dealt to the sections of `nodes` whose schema has each key; a key none has is an error."""
    dealt = {node: {} for node in nodes}
    for key, value in values.items():
        node = next((n for n in nodes if key in {f.name for f in dataclasses.fields(type(section(n)))}), None)
        if node is None:
            raise TypeError(f"{key} is a key of none of {nodes}")
        dealt[node][key] = value
    return dealt


def module(model_path, *, parallel: ParallelSettings | None = None, seed: int = 0, engine=None, **values):
    """A `CanopyModule` with train.yaml's algorithm, optim, trainer and sampling settings but for `values`."""
    dealt = split(values, ("algorithm", "optim", "trainer", "sampling"))
    return CanopyModule(
        str(model_path),
        **{node: section(node, **changed) for node, changed in dealt.items()},
        parallel=parallel or ParallelSettings(),
        seed=seed,
        engine=engine,
    )


def budget_settings(budget: Budget) -> BudgetSettings:
    return BudgetSettings(name="test", rope_scaling=None, **dataclasses.asdict(budget))


def datamodule(env, engine, tokenizer, *, budget: Budget, seed: int = 0, trajectory_log=None, **values):
    """A `RolloutDataModule` with train.yaml's data and algorithm settings but for `values` (and `sampling`,
    `max_quarantine_fraction`, `rollout_timeout_s`: train.yaml's unless given), over `budget`."""
    extra = {key: values.pop(key) for key in ("max_quarantine_fraction", "rollout_timeout_s") if key in values}
    sampling = values.pop("sampling", None)
    dealt = split(values, ("data", "algorithm"))
    cfg = _composed()
    return RolloutDataModule(
        env,
        engine,
        tokenizer,
        **{node: section(node, **changed) for node, changed in dealt.items()},
        sampling=sampling or section("sampling"),
        budget=budget_settings(budget),
        max_quarantine_fraction=extra.get("max_quarantine_fraction", cfg.env.max_quarantine_fraction),
        rollout_timeout_s=extra.get("rollout_timeout_s", cfg.trainer.rollout_timeout_s),
        seed=seed,
        trajectory_log=trajectory_log,
    )
