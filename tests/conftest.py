import os
from pathlib import Path

if "PYTEST_XDIST_WORKER" in os.environ:  # `make test` runs pytest-xdist workers: each gets its share of the cores,
    # or their OpenMP threads (and those of the ranks and runs they start) spin against each other
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))

import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from canopy.modules.canopy_module import silence_benign_warnings
from canopy.tiny_model import build_tiny_checkpoint

# The longest files of `make test` (its --durations), started first: pytest-xdist (--dist loadfile) hands out files in
# collection order, and one of these collected last keeps a worker busy minutes after the other has finished.
LONGEST_FIRST = ("test_vllm_server.py", "test_swe_attacks.py", "test_paper_checks.py", "test_gpu_check.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: every file keeps its own order


@pytest.fixture(autouse=True)
def benign_warnings_silenced():
    """As train.py does (inside each test: pytest sets up every test's warning filters afresh)."""
    silence_benign_warnings()


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(folder)` once per session; under pytest-xdist once for all workers: the first to ask builds it under
    a lock, the others read where it is (tests only read what these builds make)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    folder = tmp_path_factory.getbasetemp().parent / name
    built = folder / "built-at"
    with FileLock(f"{folder}.lock"):
        if not built.exists():
            folder.mkdir()
            built.write_text(str(build(folder)))
    return Path(built.read_text())


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random Qwen3 HF checkpoint with the word-level tokenizer, built locally once per session."""
    return built_once(tmp_path_factory, "ckpt", lambda folder: build_tiny_checkpoint(folder / "tiny-qwen3", seed=0))


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def tiny_path_even_vocab(tmp_path_factory):
    """The same tiny Qwen3 with its vocabulary padded to a multiple of 8, so every dimension shards evenly."""
    return built_once(
        tmp_path_factory,
        "ckpt8",
        lambda folder: build_tiny_checkpoint(folder / "tiny-qwen3", seed=0, pad_vocab_multiple=8),
    )


def warm_tiny_model(folder: Path, *overrides: str) -> Path:
    """The embedded default's tiny model format-warmed for 30 steps, built at `folder` as
    `train.py model.tiny.dir=<folder> model.tiny.format_warmup_steps=30 <overrides>` builds it."""
    from canopy.build import ensure_model
    from tests.helpers import config

    return Path(ensure_model(config(f"model.tiny.dir={folder}", "model.tiny.format_warmup_steps=30", *overrides)))


@pytest.fixture(scope="session")
def warm_tiny(tmp_path_factory):
    """The tiny Qwen3 the tests' train.py runs start from, built once per session (each run reads it)."""
    return built_once(tmp_path_factory, "warm", lambda folder: warm_tiny_model(folder / "tiny"))


@pytest.fixture(scope="session")
def warm_tiny_qwen3_5(tmp_path_factory):
    """The same for `model.tiny.family=qwen3_5`."""
    return built_once(
        tmp_path_factory, "warm_qwen3_5", lambda folder: warm_tiny_model(folder / "tiny", "model.tiny.family=qwen3_5")
    )


@pytest.fixture(scope="session")
def short_run(tmp_path_factory, warm_tiny):
    """One short `train.py` run of the embedded default that several tests read (tests/test_train.py,
    test_callbacks.py, test_loggers.py): 3 steps, its episodes served by 4 worker processes, evaluated at both
    budgets after every step, logged to W&B (offline) and MLflow beside TensorBoard. (run dir, completed process)"""
    from tests.helpers import train

    overrides = ("env.pool.workers=4", "eval.every_n_steps=1", "logger=[wandb,mlflow]", "logger.wandb.mode=offline")
    return train(tmp_path_factory.mktemp("short_run"), warm_tiny, 3, *overrides)
