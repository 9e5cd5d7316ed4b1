"""The serving layer's config keys, checked together: `env.max_quarantine_fraction`, `env.sandbox.*`, `env.pool.*`
(`canopy.envs.pool`) and `env.ray.*` (`canopy.envs.ray_pool`)."""

from canopy.envs import ray_pool
from canopy.envs.pool import PoolSettings
from canopy.envs.sandbox import SandboxLimits
from canopy.errors import require


def check_serving(env) -> None:
    """The serving layer's keys: `env.max_quarantine_fraction`, `env.sandbox.*`, `env.pool.*` against them, then
    `env.ray.*`."""
    require(
        isinstance(env.max_quarantine_fraction, (int, float)) and 0 < env.max_quarantine_fraction <= 1,
        f"env.max_quarantine_fraction={env.max_quarantine_fraction} must lie in (0, 1]: above this fraction of "
        "quarantined episodes a step stops the run as a broken setup (1 = only when every episode is)",
    )
    sandbox = SandboxLimits(**env.sandbox)
    PoolSettings(**env.pool).validate(sandbox)
    ray_pool.validate(env)
