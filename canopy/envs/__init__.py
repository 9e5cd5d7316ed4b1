"""Environments, one module each, found by name: `env.name=X` is `canopy.envs.X`, which defines `ENVIRONMENT` (the
class) and `environment_kwargs(env)`, which checks its `env.*` keys and returns the class's keyword arguments
(plain values: a pool sends them to its worker processes). `conf/env/X.yaml` is its config group option."""

import importlib
import pkgutil

from canopy.errors import ConfigError


def available() -> list[str]:
    """The environments of this build: the modules here that define `ENVIRONMENT`."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return sorted(name for name in names if hasattr(importlib.import_module(f"{__name__}.{name}"), "ENVIRONMENT"))


def environment_module(name: str):
    """`canopy.envs.<name>`, the one place an environment is registered."""

    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise  # the environment exists but a package it needs is missing: say that, not "no environment"
        module = None
    if module is None or not hasattr(module, "ENVIRONMENT"):
        raise ConfigError(
            f"env.name={name!r} has no environment in this build yet: use one of {', '.join(available())}"
        )
    return module


def environment_kwargs(env) -> dict:
    """The environment's own `env.*` keys, checked by its module; returns its keyword arguments. Raises
    `ConfigError` with the fix."""
    module = environment_module(env.name)
    own = getattr(module, "environment_kwargs", None)
    return own(env) if own is not None else {}


def environment_factory(name: str) -> str:
    """`module:Class` of environment `name`, as the pool's workers build it."""
    module = environment_module(name)
    return f"{module.__name__}:{module.ENVIRONMENT.__name__}"
