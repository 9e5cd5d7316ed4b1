"""canopy/compat.py: on a torch older than TorchTitan 0.3.0's (2.11, the lent GPU machine's), TorchTitan imports
for one process, and a run of several processes is refused at start in one line."""

import types

import pytest
import torch.distributed.fsdp

from canopy import compat
from canopy.errors import ConfigError


def test_an_older_torch_gets_a_stand_in_that_refuses_use():
    fsdp = types.SimpleNamespace()
    assert compat.let_torchtitan_import(fsdp) is True
    with pytest.raises(RuntimeError, match=r"FSDP / TP / CP need torch >= 2\.13"):
        fsdp.DataParallelMeshDims(shard=("dp_shard",))
    assert compat.let_torchtitan_import(fsdp) is False  # given once


def test_this_torch_keeps_its_own_fully_shard_api():
    assert compat.torch_version() >= compat.MULTIPROCESS_TORCH
    assert compat.let_torchtitan_import() is False
    assert torch.distributed.fsdp.DataParallelMeshDims is not compat.NeedsNewerTorch


def test_several_processes_on_an_older_torch_are_refused_one_is_not(monkeypatch):
    monkeypatch.setattr(compat, "version", lambda package: "2.11.0+cu130")
    compat.require_multiprocess_torch(1)
    with pytest.raises(ConfigError, match=r"this is torch 2\.11: run one process"):
        compat.require_multiprocess_torch(2)
    monkeypatch.setattr(compat, "version", lambda package: "2.13.0+cpu")
    compat.require_multiprocess_torch(8)


def test_train_refuses_fsdp_on_an_older_torch_before_building_anything(monkeypatch, tmp_path):
    from canopy.build import build_strategy
    from tests.helpers import config

    monkeypatch.setattr(compat, "version", lambda package: "2.11.0")
    with pytest.raises(ConfigError, match="torch >= 2.13"):
        build_strategy(config("trainer.devices=2", "parallelism.dp_shard=2"))
    assert build_strategy(config()) == "auto"


def test_an_interpreter_without_torch_imports_canopy(tmp_path):
    """The sandbox runner and AppWorld's venv import `canopy` on interpreters without torch."""
    import subprocess
    import sys

    probe = "import canopy, canopy.compat as c; print(c.torch_version(), c.let_torchtitan_import())"
    done = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(compat.__file__.rsplit('/', 2)[0])!r}); {probe}",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "False"]
