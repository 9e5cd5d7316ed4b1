"""FSDP2 / TP / FSDP x TP on CPU (gloo) against one process: same loss and gradients within 1e-5 in fp32
(gradients relative to each tensor's largest entry); TP ranks compute the loss from vocabulary shards."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from canopy.modules.policy import read_hf_weights
from canopy.reports.tb_scalars import read_scalars
from tests.helpers import datamodule, train, train_args
from tests.parallel_worker import free_port, run_ranks
from tests.scripted import FakeEngine

ROOT = Path(__file__).resolve().parents[1]
COMMON = ("report.eval_samples_per_task=0", "checkpoint.every_n_steps=0")  # the runs compared with one process


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, warm_tiny):
    """The one-process run of 2 steps that the runs on several processes reproduce."""
    return train(tmp_path_factory.mktemp("single"), warm_tiny, 2, *COMMON, name="single")[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,dp,tp", [(2, 2, 1), (2, 1, 2), (4, 2, 2), (4, 2, 1)], ids=["fsdp2", "tp2", "fsdp2xtp2", "hsdp2xfsdp2"]
)
def test_sharded_policy_matches_single_process(tiny_path_even_vocab, tmp_path, world, dp, tp):
    """hsdp2xfsdp2: two replicas (`parallelism.dp_replicate=2`, as across two nodes) of a 2-way FSDP model, each
    replica on its own rows: the gradients are summed over all four ranks."""
    run_ranks("tests.parallel_worker", world, tiny_path_even_vocab, dp, tp, tmp_path)
    for rank in range(world):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["weight_diff"] == 0.0  # sharded loading is exact
        assert abs(result["loss"] - result["full_loss"]) < 1e-5
        assert result["grad_diff"] < 1e-5, [
            rank,
            *((key, result[key]) for key in ("grad_diff_tensor", "grad_diff", "rerun_grad_diff", "machine")),
        ]
        # loss parallel: a TP rank scores tokens from its own vocabulary shard, never the gathered logits
        assert result["local_vocab"] == result["vocab"] // tp
        assert result["full_tensor_calls"] == 0
        # weight sync / export: the whole weights on rank 0 only (the others walk meta tensors), and gathered
        # straight into rank 0 except FSDP x TP's strided shards, which are all-gathered
        assert result["export_diff"] == 0.0 if rank == 0 else result["export_on_meta"]
        assert (result["export_full_tensor_calls"] > 0) == (dp > 1 and tp > 1)


@pytest.mark.slow
def test_a_rank_exits_cleanly_past_a_late_gloo_worker(tmp_path):
    """A gloo worker thread that waits for the GIL to free a collective's tensors when the rank ends: `run_rank`
    ends the rank without the interpreter's finalization, which would abort it (tests/gloo_teardown_worker.py)."""
    command = [sys.executable, "-m", "tests.gloo_teardown_worker", str(free_port()), str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-3000:]
    assert "terminate called" not in run.stderr
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]


END_RANK_SCRIPT = """
import logging, multiprocessing, sys, time
import torch.distributed as dist
from canopy.modules.parallel import end_rank

dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
child = multiprocessing.Process(target=time.sleep, args=(600,))
child.start()
print(child.pid)  # buffered: stdout is a pipe
logging.basicConfig(filename="{log}", level=logging.INFO)
logging.info("last words")
end_rank()
print("after end_rank")
"""


def test_end_rank_leaves_no_child_no_process_group_and_loses_no_output(tmp_path):
    """`end_rank` skips finalization (os._exit), so it does itself what finalization would have: the buffered output
    and the log reach their files, the process group is gone and no child process is left behind (an orphan)."""
    script = END_RANK_SCRIPT.format(store=tmp_path / "store", log=tmp_path / "run.log")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as in a pipe
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split()
    assert len(lines) == 1 and "after end_rank" not in run.stdout  # the process ended in end_rank
    child = int(lines[0])
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    assert "last words" in (tmp_path / "run.log").read_text()
    assert not (tmp_path / "store").exists()  # the file store goes with the destroyed process group


@pytest.mark.slow
def test_train_py_on_two_processes_matches_one(tmp_path, warm_tiny, single_run):
    """`python train.py trainer.devices=2 parallelism.dp_shard=2` (FSDP) and `parallelism.tp=2` run the embedded
    default on CPU and reproduce the single-process run step for step: same batches (rank 0 generates and
    broadcasts), same losses and gradient norms."""
    single = read_scalars(single_run / "tensorboard")
    for name, overrides in {"fsdp": ["parallelism.dp_shard=2"], "tp": ["parallelism.tp=2"]}.items():
        run_dir, _ = train(tmp_path, warm_tiny, 2, *COMMON, "trainer.devices=2", *overrides, name=name)
        sharded = read_scalars(run_dir / "tensorboard")
        for tag in ("actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm", "reward/success"):
            for (_, a), (_, b) in zip(single[tag], sharded[tag], strict=True):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (name, tag, a, b)
        assert all(v < 1e-5 for _, v in sharded["mismatch/logprob_gap"])  # each rank measured against rank 0's samples
        assert (run_dir / "final_hf" / "model.safetensors.index.json").is_file()


@pytest.mark.slow
def test_torchrun_on_two_nodes_reproduces_one_process(tmp_path, warm_tiny, single_run):
    """`torchrun --nnodes 2 --node-rank r ... train.py trainer.num_nodes=2 parallelism.dp_replicate=2`, both "nodes"
    on this machine (gloo): HSDP's two replicas each train on their own rows and reproduce the one-process run step
    for step; only rank 0 generates, and the final checkpoint is gathered into rank 0 alone."""
    run_dir, port = tmp_path / "two_nodes", free_port()
    argv = train_args(warm_tiny, run_dir, 2, *COMMON, "trainer.num_nodes=2", "parallelism.dp_replicate=2")
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={r}"]
            + ["--master-addr=127.0.0.1", f"--master-port={port}", "train.py", *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]  # one process group over both nodes
    single, sharded = read_scalars(single_run / "tensorboard"), read_scalars(run_dir / "tensorboard")
    for tag in ("actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm", "reward/success", "actor/action_tokens"):
        for (_, a), (_, b) in zip(single[tag], sharded[tag], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (tag, a, b)
    final, reference = read_hf_weights(run_dir / "final_hf"), read_hf_weights(single_run / "final_hf")
    assert final.keys() == reference.keys()
    for name, tensor in final.items():
        assert torch.allclose(tensor, reference[name], atol=1e-5), name


def test_parallel_degrees_must_match_devices_and_nodes():
    from canopy.build import build_strategy
    from canopy.config import validate
    from canopy.errors import ConfigError
    from tests.helpers import config

    with pytest.raises(ConfigError, match="trainer.devices=2 x trainer.num_nodes=1"):
        validate(config("trainer.devices=2"))
    with pytest.raises(ConfigError, match="must divide trainer.devices"):
        validate(config("trainer.num_nodes=2", "parallelism.tp=2"))  # TP across nodes
    validate(config("trainer.num_nodes=2", "parallelism.dp_replicate=2"))
    hsdp = build_strategy(
        config("trainer.num_nodes=2", "trainer.devices=2", "parallelism.dp_replicate=2", "parallelism.dp_shard=2")
    )
    assert (hsdp._data_parallel_size, hsdp._tensor_parallel_size) == (4, 1)
    assert build_strategy(config()) == "auto"


def test_only_global_rank_zero_builds_the_engine(tokenizer):
    """The datamodule builds its engine on first use, and only the generating rank uses it: the other ranks walk
    weight syncs and checkpoint state without ever building one."""
    built = []

    class Engine(FakeEngine):
        def __init__(self):
            built.append(self)
            self.generator, self.version = torch.Generator().manual_seed(0), 0

        def update_weights(self, named_tensors, version):
            list(named_tensors)
            self.version = version

        def rng_state(self):
            return self.generator.get_state()

        def load_rng_state(self, state):
            self.generator.set_state(state)

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
def test_qwen3_5_with_fsdp_on_two_processes_matches_one(tmp_path, warm_tiny_qwen3_5):
    """`train.py model.tiny.family=qwen3_5 trainer.devices=2 parallelism.dp_shard=2`: Qwen3.5 sharded with
    TorchTitan's parallelize_qwen3_5 and loaded one decoder layer at a time reproduces one process step for step."""
    common = ("report.eval_samples_per_task=0", "model.tiny.family=qwen3_5", "callbacks=none")
    single = read_scalars(train(tmp_path, warm_tiny_qwen3_5, 2, *common, name="single")[0] / "tensorboard")
    run_dir, _ = train(
        tmp_path, warm_tiny_qwen3_5, 2, *common, "trainer.devices=2", "parallelism.dp_shard=2", name="fsdp"
    )
    sharded = read_scalars(run_dir / "tensorboard")
    for tag in ("actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm", "reward/success"):
        for (_, a), (_, b) in zip(single[tag], sharded[tag], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (tag, a, b)
    assert (run_dir / "final_hf" / "model.safetensors.index.json").is_file()
