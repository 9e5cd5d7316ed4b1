"""The rollout stream of a sharded run: rank 0 generates while the other ranks wait on the store, outside any
collective, so a rollout step may outlast the process group's timeout; each data-parallel shard receives only its
own rows; a failure of rank 0's rollout stops every rank with its cause; a follower gives up after
`rollout_timeout_s` with a line naming the key. Rank 0's evaluations are waited for the same way.

Two gloo ranks with a 2 s process-group timeout and rollout steps and an evaluation that take 3.5 s on rank 0."""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from canopy.callbacks.budget_transfer import BudgetTransferEval
from canopy.datamodules.rollout import RolloutDataModule, RolloutStream, split_rows
from canopy.envs.base import SystemicFaultError, Task
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.step import pack
from tests.helpers import BUDGET, datamodule_over, trajectory
from tests.parallel_worker import free_port

ROLLOUT_S, COLLECTIVE_TIMEOUT_S = 3.5, 2


def step_batch(step: int):
    """Step `step`'s batch: 5 episodes of distinct lengths, so that every row is recognisable."""
    task = Task("t", 1, "s")
    trajectories = [trajectory(task, i, success=i % 2, length=4 + i + step) for i in range(5)]
    batch = pack(trajectories, torch.arange(5, dtype=torch.float), pad_token_id=0)
    batch.metrics = {"step": float(step)}
    return batch


class SlowRollouts(RolloutDataModule):
    """Rank 0's rollout steps take ROLLOUT_S each; `failure` is raised instead at step 1."""

    failure: Exception | None = None

    def next_batch(self):
        time.sleep(ROLLOUT_S)
        if self.step == 1 and self.failure is not None:
            raise self.failure
        self.step += 1
        return step_batch(self.step - 1)


def rank_main(rank: int, port: int, scenario: str, out: str) -> None:
    # the rendezvous may wait long for the other rank's start (a loaded machine); the collectives time out at 2 s
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims

    parallel_dims_module.device_type = "cpu"
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
    dims.build_mesh()
    dm = datamodule_over(
        EmbeddedEnvironment(),
        lambda: None,
        None,
        kind=SlowRollouts,
        tasks_per_step=1,
        group_size=5,
        budget=BUDGET,
        rollout_timeout_s=1 if scenario == "follower_gives_up" else 60,
    )
    dm.failure = SystemicFaultError("the environment's workers cannot start") if scenario == "failure" else None
    module = SimpleNamespace(parallel_dims=dims, updates_per_batch=1)
    dm.trainer = SimpleNamespace(world_size=2, is_global_zero=rank == 0, global_rank=rank, lightning_module=module)
    dm.trainer.datamodule = dm
    stream, result = RolloutStream(dm), {"rows": []}
    try:
        for _ in range(2):
            batch = next(stream)
            result["rows"].append({"ids": batch.input_ids.tolist(), "metrics": batch.metrics})
        # then rank 0 evaluates for ROLLOUT_S (budget transfer), and every rank meets in a collective
        callback = BudgetTransferEval.__new__(BudgetTransferEval)
        callback.evaluations, callback._evaluate_on_rank0 = 0, lambda *args: time.sleep(ROLLOUT_S) or [{"tgc": 1}]
        result["evaluated"] = callback.evaluate(dm.trainer, module)
        dist.barrier()
    except Exception as error:  # noqa: BLE001 (the test reads what each rank raised)
        result["error"] = f"{type(error).__name__}: {error}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a rank whose peer gave up must not wait for it in the process group's shutdown


def run(scenario: str, tmp_path: Path) -> list[dict]:
    import subprocess

    command = [sys.executable, "-m", "tests.test_rollout_stream", str(free_port()), scenario, str(tmp_path)]
    subprocess.run(command, cwd=Path(__file__).resolve().parents[1], timeout=120, check=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_followers_wait_outside_collectives_and_get_their_own_rows(tmp_path):
    """Two rollout steps, then a budget-transfer evaluation, each longer on rank 0 than the collective timeout."""
    ranks = run("ok", tmp_path)
    for rank, result in enumerate(ranks):
        assert "error" not in result, result["error"]  # 3.5 s on rank 0 did not trip the 2 s collective timeout
        for step, received in enumerate(result["rows"]):
            expected = split_rows(step_batch(step), 2)[rank]
            assert received["ids"] == expected.input_ids.tolist()  # rows rank::2, trimmed to their longest
            assert received["metrics"] == {"step": float(step)}  # the whole step's metrics on every shard
    assert len(ranks[0]["rows"][0]["ids"]) == 3 and len(ranks[1]["rows"][0]["ids"]) == 2
    assert ranks[0]["evaluated"] == [{"tgc": 1}] and ranks[1]["evaluated"] == []


@pytest.mark.slow
def test_a_failed_rollout_stops_every_rank_with_its_cause(tmp_path):
    for result in run("failure", tmp_path):
        assert len(result["rows"]) == 1
        assert result["error"] == "SystemicFaultError: the environment's workers cannot start"


@pytest.mark.slow
def test_a_follower_gives_up_after_rollout_timeout_naming_the_key(tmp_path):
    follower = run("follower_gives_up", tmp_path)[1]
    assert follower["rows"] == []
    assert "waited 1 s for rank 0's rollout step" in follower["error"]
    assert "raise trainer.rollout_timeout_s" in follower["error"]


def test_too_few_survivors_for_the_shards_is_one_line():
    with pytest.raises(SystemicFaultError, match="5 surviving episodes cannot feed 2 data-parallel shards x 3"):
        split_rows(step_batch(0), 2, min_rows=3)


if __name__ == "__main__":
    port, scenario, out = sys.argv[1:4]
    torch.multiprocessing.spawn(rank_main, args=(int(port), scenario, out), nprocs=2)
