"""Environments, found by name. `env.name=X` is, in this order:
- a module of this folder, `canopy.envs.X` (`conf/env/X.yaml` is its config group option);
- an entry point `X` of the group `canopy.environments` in an installed package (`X = "mypkg.my_env"`);
- an import path outside Canopy's tree, `env.name=mypkg.my_env` (a dotted name; importable on `sys.path`).

The module defines `ENVIRONMENT` (the class) and optionally `SETTINGS` (a dataclass: its `env.<key>.*` schema) and
`environment_kwargs(env)`, which checks its `env.*` keys and returns the class's keyword arguments (plain values: a
pool sends them to its worker processes). What it needs installed is `env.requires` (pip requirements, checked
before the module is imported: one line naming the install when one is missing).

This folder's modules are imported at start, for their settings schemas (`canopy.config`): they import optional
packages inside their methods, and one that fails to import breaks only itself. A module found by entry point or
import path is imported only when a run chooses it."""

import functools
import importlib
import importlib.metadata
import pkgutil
import sys
from types import ModuleType

from packaging.requirements import InvalidRequirement, Requirement

from canopy.envs.base import Environment
from canopy.errors import ConfigError
from canopy.protocols import mismatches

ENTRY_POINTS = "canopy.environments"


def built_in() -> list[str]:
    """The modules of this folder, by name."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_") and not m.ispkg)


@functools.cache
def built_in_environments() -> dict[str, ModuleType]:
    """{name: module} of this folder's modules that define `ENVIRONMENT`. A module that does not import (a package
    it imports at the top is missing) is left out here, so it breaks only itself: choosing it says what to install."""
    modules = {}
    for name in built_in():
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ImportError:
            continue
        if hasattr(module, "ENVIRONMENT"):
            modules[name] = module
    return modules


def entry_points() -> dict[str, str]:
    """{name: module} of the installed packages' `canopy.environments` entry points."""
    return {point.name: point.value for point in importlib.metadata.entry_points(group=ENTRY_POINTS)}


def available() -> list[str]:
    """The environments of this build: this folder's and the installed entry points'."""
    return sorted({*built_in_environments(), *entry_points()})


def module_path(name: str) -> str:
    """The module `env.name=<name>` imports."""
    if name in built_in():
        return f"{__name__}.{name}"
    if name in (points := entry_points()):
        return points[name]
    if "." in name:
        return name
    raise ConfigError(
        f"env.name={name!r} has no environment in this build yet: use one of {', '.join(available())}, or an "
        "import path to your own module (env.name=mypkg.my_env; docs/environments.md)"
    )


def check_requirements(name: str, requires) -> None:
    """Each pip requirement of `env.requires` is installed in this Python at an allowed version."""
    for line in requires or ():
        try:
            requirement = Requirement(str(line))
        except InvalidRequirement as error:
            raise ConfigError(f"env.requires: {line!r} is not a pip requirement ({error}): e.g. 'mypkg>=1.2'") from None
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            version = None
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            found = "is not installed" if version is None else f"is at {version}"
            raise ConfigError(
                f"env.name={name} needs {requirement}, which {found} in {sys.prefix}: pip install '{requirement}'"
            )


def environment_module(name: str, requires=()):
    """The module of environment `name`, imported after its `requires` are checked. A package the module imports
    that is missing stops this environment, not Canopy: one line naming the install."""
    check_requirements(name, requires)
    path = module_path(name)
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as error:
        if not error.name or path == error.name or path.startswith(error.name + "."):
            raise ConfigError(
                f"env.name={name}: no module {path!r} on sys.path: check the name, or install its package "
                "(pip install -e <its folder>) or add its folder to PYTHONPATH"
            ) from None
        package = error.name.split(".")[0]
        raise ConfigError(
            f"env.name={name}: its module {path} imports {package!r}, which is not installed in {sys.prefix}: "
            f"pip install {package} (the package's pip name may differ; declare it in env.requires)"
        ) from None
    if not hasattr(module, "ENVIRONMENT") and path.startswith(f"{__name__}."):  # one of the helpers here
        raise ConfigError(
            f"env.name={name!r} has no environment in this build yet: use one of {', '.join(available())}"
        )
    if not hasattr(module, "ENVIRONMENT"):
        raise ConfigError(
            f"env.name={name}: module {path} defines no ENVIRONMENT: set ENVIRONMENT = <its environment class> "
            "(docs/environments.md)"
        )
    missing = mismatches(module.ENVIRONMENT, Environment)
    if missing:
        raise ConfigError(
            f"env.name={name}: {path}.{module.ENVIRONMENT.__name__} does not implement the Environment protocol "
            f"(canopy/envs/base.py): {'; '.join(missing)}; an in-process environment declares "
            "`max_concurrent_episodes = None` and `def close(self): pass` (docs/environments.md)"
        )
    return module


def environment_kwargs(env) -> dict:
    """The environment's own `env.*` keys, checked by its module; returns its keyword arguments as plain values
    (an OmegaConf list or dict among them converted: a pool sends them to its workers as JSON). Raises `ConfigError`
    with the fix."""
    from omegaconf import OmegaConf

    module = environment_module(env.name, env.get("requires"))
    own = getattr(module, "environment_kwargs", None)
    kwargs = own(env) if own is not None else {}
    return {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in kwargs.items()}


def environment_factory(name: str) -> str:
    """`module:Class` of environment `name`, as the pool's workers build it."""
    module = environment_module(name)
    return f"{module.__name__}:{module.ENVIRONMENT.__name__}"
