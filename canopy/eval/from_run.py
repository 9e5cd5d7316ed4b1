"""What `evaluate.py checkpoint=<run>/...` takes from the training run it evaluates: the run's own command-line
overrides of its experiment, environment and model (`<run>/.hydra/overrides.yaml`), placed before the evaluation's
own, so that a policy trained on `env.name=mypkg.my_env` is evaluated there and not on the default environment.
Any of them given again on the evaluation's command line wins (Hydra: the later override of a key)."""

from pathlib import Path

from omegaconf import OmegaConf

INHERITED = ("experiment", "env", "model")  # the override keys (and their sub-keys) taken from the run


def run_dir_of(checkpoint: str | Path) -> Path | None:
    """The training run a checkpoint was written in (`<run>/final_hf`, `<run>/checkpoints/step<N>.ckpt`): the
    nearest folder above it holding Hydra's record of the run, or None (a checkpoint from elsewhere)."""
    for folder in list(Path(checkpoint).resolve().parents)[:3]:
        if (folder / ".hydra" / "overrides.yaml").is_file():
            return folder
    return None


def override_key(override: str) -> str:
    """`env.pool.workers` of `+env.pool.workers=2`; `budget@eval.enlarged` of `budget@eval.enlarged=enlarged`."""
    return override.split("=", 1)[0].lstrip("+~")


def inherited_overrides(argv: list[str]) -> tuple[Path | None, list[str]]:
    """(the run, its overrides to prepend) for the evaluation's command line `argv`: the run's overrides of
    `INHERITED` keys that `argv` does not set, itself or above (`env=rgym` sets every `env.*`; `experiment=` sets
    them all). None and [] without a `checkpoint=` from a training run."""
    checkpoint = next((arg.split("=", 1)[1] for arg in argv if override_key(arg) == "checkpoint"), None)
    run = run_dir_of(checkpoint) if checkpoint and checkpoint != "null" else None
    if run is None:
        return None, []
    given = {override_key(arg) for arg in argv}
    if "experiment" in given:
        return run, []

    def set_by_argv(key: str) -> bool:
        return any(key == g or key.startswith(f"{g}.") for g in given)

    overrides = [str(o) for o in OmegaConf.load(run / ".hydra" / "overrides.yaml")]
    return run, [o for o in overrides if (key := override_key(o)).split(".")[0] in INHERITED and not set_by_argv(key)]
