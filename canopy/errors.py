"""The run's stop reasons under one base (`RunStopped`), the error every component raises for a setting it cannot
run with, and its checks: a leaf module (it imports nothing from Canopy), so that any layer can use them."""


class RunStopped(Exception):
    """A reason the run stops with one line, `f"{error.label}: {error}"` (train.py, evaluate.py), and which the
    generating rank relays to the others as it is (canopy/datamodules/rollout.py). Each subclass keeps its own
    built-in base too (`ConfigError` a ValueError, the others RuntimeErrors): `label` is the line's prefix.
    `ConfigError` here, `SystemicFaultError` (canopy/envs/base.py), `OffPolicyError` (canopy/mismatch.py),
    `FormatDriftError` (canopy/callbacks/format_monitor.py)."""

    label = "run stopped"


class ConfigError(RunStopped, ValueError):
    """A configuration value Canopy cannot run with; the message says what to change."""

    label = "config error"


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
