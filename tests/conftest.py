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
