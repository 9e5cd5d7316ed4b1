"""FSDP2 / TP / FSDP x TP on CPU (gloo) against one process: same loss and gradients within 1e-5 in fp32
(gradients relative to each tensor's largest entry); TP ranks compute the loss from vocabulary shards."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from canopy.tools.tb_scalars import read_scalars
from tests.parallel_worker import run_ranks
from tests.test_datamodule import datamodule
from tests.test_train import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2), (2, 2)], ids=["fsdp2", "tp2", "fsdp2xtp2"])
def test_sharded_policy_matches_single_process(tiny_path_even_vocab, tmp_path, dp, tp):
    world = dp * tp
    run_ranks("tests.parallel_worker", world, tiny_path_even_vocab, dp, tp, tmp_path)
    for rank in range(world):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["weight_diff"] == 0.0  # sharded loading is exact
        assert abs(result["loss"] - result["full_loss"]) < 1e-5
        assert result["grad_diff"] < 1e-5
        # loss parallel: a TP rank scores tokens from its own vocabulary shard, never the gathered logits
        assert result["local_vocab"] == result["vocab"] // tp
        assert result["full_tensor_calls"] == 0


@pytest.mark.slow
def test_train_py_on_two_processes_matches_one(tmp_path):
    """`python train.py trainer.devices=2 parallelism.dp_shard=2` (FSDP) and `parallelism.tp=2` run the embedded
    default on CPU and reproduce the single-process run step for step: same batches (rank 0 generates and
    broadcasts), same losses and gradient norms."""
    single = read_scalars(train(tmp_path, 2, "report.eval_samples_per_task=0", name="single")[0] / "tensorboard")
    for name, overrides in {"fsdp": ["parallelism.dp_shard=2"], "tp": ["parallelism.tp=2"]}.items():
        run_dir, _ = train(tmp_path, 2, "report.eval_samples_per_task=0", "trainer.devices=2", *overrides, name=name)
        sharded = read_scalars(run_dir / "tensorboard")
        for tag in ("actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm", "reward/success"):
            for (_, a), (_, b) in zip(single[tag], sharded[tag], strict=True):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (name, tag, a, b)
        assert all(v < 1e-5 for _, v in sharded["mismatch/logprob_gap"])  # each rank measured against rank 0's samples
        assert (run_dir / "final_hf" / "model.safetensors").is_file()


def test_parallel_degrees_must_match_devices():
    from canopy.build import build_strategy
    from canopy.config import ConfigError
    from tests.test_config import config

    with pytest.raises(ConfigError, match="trainer.devices"):
        build_strategy(config("trainer.devices=2"))
    assert build_strategy(config()) == "auto"


def test_only_global_rank_zero_builds_the_engine(tokenizer):
    """The datamodule builds its engine on first use, and only the generating rank uses it: the other ranks walk
    weight syncs and checkpoint state without ever building one."""
    built = []

    class Engine:
        def __init__(self):
            built.append(self)
            self.generator, self.version = torch.Generator().manual_seed(0), 0

        def update_weights(self, named_tensors, version):
            list(named_tensors)
            self.version = version

    weights = [("w", torch.zeros(1))]
    other, zero = datamodule(tokenizer, Engine), datamodule(tokenizer, Engine)  # the class is the builder
    other.trainer, zero.trainer = SimpleNamespace(is_global_zero=False), SimpleNamespace(is_global_zero=True)
    other.engine_handle.sync(iter(weights), 1, generating=False)
    state = zero.state_dict()  # rank 0's checkpoint state, which every rank loads on resume
    other.load_state_dict(state)
    assert built == [zero.engine] and "engine_rng" not in other.state_dict() and other.engine_handle.version == 1
    zero.engine_handle.sync(iter(weights), 1, generating=True)
    assert built == [zero.engine] and zero.engine.version == 1 and "engine_rng" in state


@pytest.mark.slow
def test_qwen3_5_with_fsdp_on_two_processes_matches_one(tmp_path):
    """`train.py model.tiny.family=qwen3_5 trainer.devices=2 parallelism.dp_shard=2`: Qwen3.5 sharded with
    TorchTitan's parallelize_qwen3_5 and loaded one decoder layer at a time reproduces one process step for step."""
    common = ("report.eval_samples_per_task=0", "model.tiny.family=qwen3_5", "callbacks=none")
    single = read_scalars(train(tmp_path, 2, *common, name="single")[0] / "tensorboard")
    run_dir, _ = train(tmp_path, 2, *common, "trainer.devices=2", "parallelism.dp_shard=2", name="fsdp")
    sharded = read_scalars(run_dir / "tensorboard")
    for tag in ("actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm", "reward/success"):
        for (_, a), (_, b) in zip(single[tag], sharded[tag], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (tag, a, b)
    assert (run_dir / "final_hf" / "model.safetensors").is_file()
