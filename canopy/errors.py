"""The error every component raises for a setting it cannot run with, and its checks: a leaf module (it imports
nothing from Canopy), so that any layer can use them."""


class ConfigError(ValueError):
    """A configuration value Canopy cannot run with; the message says what to change."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
