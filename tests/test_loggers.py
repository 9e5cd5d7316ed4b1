"""Loggers as a config group: TensorBoard always, W&B (offline here) and MLflow (a local SQLite store here) beside
it with the same metric names, and the run's episodes handed to each at the end."""

import glob
import json

import pytest
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

from canopy.errors import ConfigError
from canopy.loggers import EPISODE_COLUMNS, build_loggers
from canopy.reports.tb_scalars import read_scalars
from tests.helpers import config


def test_the_group_composes_tensorboard_first_and_checks_its_values(tmp_path):
    assert [type(x) for x in build_loggers(config(), tmp_path)] == [TensorBoardLogger]
    both = config("logger=[wandb,mlflow]", "logger.wandb.mode=offline")
    assert [type(x) for x in build_loggers(both, tmp_path)] == [TensorBoardLogger, WandbLogger, MLFlowLogger]
    assert [type(x) for x in build_loggers(config("logger=mlflow"), tmp_path)] == [TensorBoardLogger, MLFlowLogger]
    with pytest.raises(ConfigError, match="logger.wandb.mode='sometimes' is unknown: use one of online, offline"):
        build_loggers(config("logger=wandb", "logger.wandb.mode=sometimes"), tmp_path)
    with pytest.raises(ConfigError, match=r"logger \['neptune'\] is unknown: pick from conf/logger/"):
        build_loggers(config("+logger.neptune={}"), tmp_path)


def wandb_history(run_dir) -> dict[str, list[float]]:
    """Metric name -> values of the offline run's history rows, read from its record log (LevelDB's log format:
    32 KiB blocks after a 7-byte file header; each record a 7-byte header of CRC, length and full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))[0], "rb").read()
    history: dict[str, list[float]] = {}
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        if left < 7 or kind == 0:  # the block's zero padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            for item in record.history.item if record.HasField("history") else []:
                history.setdefault(item.key or "/".join(item.nested_key), []).append(json.loads(item.value_json))
    return history


@pytest.mark.slow
def test_wandb_and_mlflow_get_every_metric_under_its_tensorboard_name_and_the_episodes(short_run):
    run_dir, run = short_run
    assert "logger=[wandb,mlflow]" in run.args and "eval.every_n_steps=1" in run.args
    tensorboard = read_scalars(run_dir / "tensorboard")
    names = ["actor/loss", "actor/kl", "reward/success", "coverage/mixed", "eval/training_budget/tgc_all"]
    assert all(name in tensorboard for name in names)

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("canopy").experiment_id])
    assert run.info.run_name == run_dir.name
    for name in names:  # the same values at the same steps
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert [step for step, _ in logged] == [step for step, _ in tensorboard[name]], name
        assert [v for _, v in logged] == pytest.approx([v for _, v in tensorboard[name]]), name
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "viewer.html" in artifacts and "trajectories" in artifacts
    streams = {a.path for a in client.list_artifacts(run.info.run_id, "trajectories")}
    assert "trajectories/train" in streams and "trajectories/eval_embedded" in streams

    history = wandb_history(run_dir)
    for name in names:
        assert history.get(name) == pytest.approx([v for _, v in tensorboard[name]]), name
    files = run_dir / "wandb" / "offline-run-*" / "files" / "media"
    (table,) = glob.glob(str(files / "table" / "episodes" / "last_step_*.table.json"))
    episodes = json.loads(open(table).read())
    assert episodes["columns"] == EPISODE_COLUMNS and len(episodes["data"]) == 16  # step 2: 4 tasks x 4 rollouts
    assert {row[0] for row in episodes["data"]} == {2}
    (page,) = glob.glob(str(files / "html" / "episodes" / "viewer_*.html"))
    assert open(page).read() == (run_dir / "viewer.html").read_text()
