from pathlib import Path

import pytest
from transformers import AutoTokenizer

from canopy.modules.canopy_module import silence_benign_warnings
from canopy.tools.tiny_model import build_tiny_checkpoint


@pytest.fixture(autouse=True)
def benign_warnings_silenced():
    """As train.py does (inside each test: pytest sets up every test's warning filters afresh)."""
    silence_benign_warnings()


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random Qwen3 HF checkpoint with the word-level tokenizer, built locally once per session."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def tiny_path_even_vocab(tmp_path_factory):
    """The same tiny Qwen3 with its vocabulary padded to a multiple of 8, so every dimension shards evenly."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt8") / "tiny-qwen3", seed=0, pad_vocab_multiple=8)


def warm_tiny_model(folder: Path, *overrides: str) -> Path:
    """The embedded default's tiny model format-warmed for 30 steps, built at `folder` as
    `train.py model.tiny.dir=<folder> model.tiny.format_warmup_steps=30 <overrides>` builds it."""
    from canopy.build import ensure_model
    from tests.test_config import config

    return Path(ensure_model(config(f"model.tiny.dir={folder}", "model.tiny.format_warmup_steps=30", *overrides)))


@pytest.fixture(scope="session")
def warm_tiny(tmp_path_factory):
    """The tiny Qwen3 the tests' train.py runs start from, built once per session (each run reads it)."""
    return warm_tiny_model(tmp_path_factory.mktemp("warm") / "tiny")


@pytest.fixture(scope="session")
def warm_tiny_qwen3_5(tmp_path_factory):
    """The same for `model.tiny.family=qwen3_5`."""
    return warm_tiny_model(tmp_path_factory.mktemp("warm_qwen3_5") / "tiny", "model.tiny.family=qwen3_5")


@pytest.fixture(scope="session")
def short_run(tmp_path_factory, warm_tiny):
    """One short `train.py` run of the embedded default that several tests read (tests/test_train.py,
    test_callbacks.py, test_loggers.py): 3 steps, its episodes served by 4 worker processes, evaluated at both
    budgets after every step, logged to W&B (offline) and MLflow beside TensorBoard. (run dir, completed process)"""
    from tests.test_train import train

    overrides = ("env.pool.workers=4", "eval.every_n_steps=1", "logger=[wandb,mlflow]", "logger.wandb.mode=offline")
    return train(tmp_path_factory.mktemp("short_run"), warm_tiny, 3, *overrides)
