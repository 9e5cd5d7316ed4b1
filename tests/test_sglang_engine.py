"""SGLangEngine against a fake SGLang 0.5.x HTTP server (stdlib, in a thread): request bodies, reply parsing,
load balancing, retries and faults, weight-version checks, disk and distributed weight-sync choreography."""

import inspect
import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from canopy.build import build_engine
from canopy.callbacks import BudgetTransferEval
from canopy.config import validate
from canopy.envs.base import Task
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.errors import ConfigError
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.chat import render_prompt
from canopy.rollout.engine import EngineFault, SamplingParams
from canopy.rollout.http.client import client_host
from canopy.rollout.sglang import SGLangEngine, SGLangSettings, StaleSampleError, serving_dtype
from canopy.rollout.sglang.servers import launch_command
from canopy.rollout.sglang.weight_sync import GROUP_NAME, broadcast_from_trainer, init_custom_process_group
from tests.fake_sglang import FakeSGLang
from tests.helpers import STOPS, UNFILTERED, config, sglang_engine_for, tiny_weights

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")


@pytest.fixture
def fake():
    servers = []

    def make(**kwargs):
        servers.append(FakeSGLang(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def test_attach_resets_to_base_then_requests_and_replies(tiny_path, tmp_path, fake):
    server = fake()
    engine = sglang_engine_for(tiny_path, tmp_path, [server])
    assert server.paths() == ["/health_generate", "/update_weights_from_disk", "/model_info"]
    assert server.calls[1][1] == {"model_path": str(Path(tiny_path).resolve()), "weight_version": "0"}

    sampling = SamplingParams(temperature=0.6, top_p=0.95, top_k=20)
    stop, cut, empty = engine.generate([[5, 6, 7], [5, 6], [5]], [10, 1, 0], sampling)
    assert (stop.token_ids, stop.logprobs, stop.finish_reason) == ([7, 8, 2], [-0.25, -0.5, -0.75], "stop")
    assert stop.weight_version == 0
    assert (cut.token_ids, cut.finish_reason) == ([7], "length")
    assert (empty.token_ids, empty.finish_reason) == ([], "length")  # nothing left to generate: no request
    bodies = sorted(server.bodies("/generate"), key=lambda b: len(b["input_ids"]))
    assert bodies[1] == {
        "input_ids": [5, 6, 7],
        "sampling_params": {
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "max_new_tokens": 10,
            "stop_token_ids": [0, 2],
            "skip_special_tokens": False,
            "no_stop_trim": True,
        },
        "return_logprob": True,
    }
    assert len(bodies) == 2 and bodies[0]["sampling_params"]["max_new_tokens"] == 1


def test_requests_go_to_the_server_with_fewest_in_flight(tiny_path, tmp_path, fake):
    a, b = fake(delay=0.2), fake(delay=0.2)
    engine = sglang_engine_for(tiny_path, tmp_path, [a, b])
    generations = engine.generate([[5, i] for i in range(8)], [4] * 8, UNFILTERED)
    assert all(g.token_ids == [7, 8, 2] for g in generations)
    assert len(a.bodies("/generate")) == len(b.bodies("/generate")) == 4


def test_aborted_5xx_and_dropped_requests_are_retried_then_fault(tiny_path, tmp_path, fake):
    server = fake()
    engine = sglang_engine_for(tiny_path, tmp_path, [server], max_retries=2)
    server.failures = ["abort", "500"]
    [ok] = engine.generate([[5]], [4], UNFILTERED)
    assert ok.token_ids == [7, 8, 2] and len(server.bodies("/generate")) == 3
    server.failures = ["drop", "abort", "500"]
    [fault] = engine.generate([[5]], [4], UNFILTERED)
    assert isinstance(fault, EngineFault) and fault.reason == "engine_request_failed"
    assert len(server.bodies("/generate")) == 6  # 1 try + 2 retries


def test_refused_connections_fail_over_to_a_live_server_then_fault(tiny_path, tmp_path, fake):
    a, b = fake(), fake()
    engine = sglang_engine_for(tiny_path, tmp_path, [a, b])
    a.stop()
    assert all(g.token_ids == [7, 8, 2] for g in engine.generate([[5], [6], [7]], [4] * 3, UNFILTERED))
    assert len(b.bodies("/generate")) == 3
    b.stop()
    faults = engine.generate([[5], [6]], [4, 4], UNFILTERED)
    assert [f.reason for f in faults] == ["engine_request_failed"] * 2 and "Connection refused" in str(faults[0])


def test_rejected_request_raises_without_retry(tiny_path, tmp_path, fake):
    server = fake()
    engine = sglang_engine_for(tiny_path, tmp_path, [server])
    server.failures = ["400"]
    with pytest.raises(RuntimeError, match="rejected a /generate request"):
        engine.generate([[5]], [4], UNFILTERED)
    assert len(server.bodies("/generate")) == 1


def test_samples_from_another_weight_version_are_refused(tiny_path, tmp_path, fake):
    server = fake()
    engine = sglang_engine_for(tiny_path, tmp_path, [server])
    server.report_version = "7"
    with pytest.raises(StaleSampleError, match=r"\['7'\] but the engine holds 0"):
        engine.generate([[5]], [4], UNFILTERED)
    spans = [{"version": "-1", "start": 0, "end": 1}, {"version": "0", "start": 1, "end": 2}]  # updated mid-request
    reply = {
        "meta_info": {
            "finish_reason": {"type": "length"},
            "weight_version": "0",
            "weight_versions": spans,
            "output_token_logprobs": [[-1.0, 3, None], [-1.0, 4, None]],
        }
    }
    with pytest.raises(StaleSampleError):
        engine.backend.parse(reply, engine.weight_version)


def test_disk_sync_writes_a_loadable_checkpoint_and_drives_the_servers_in_order(tiny_path, tmp_path, fake):
    a, b = fake(), fake()
    engine = sglang_engine_for(tiny_path, tmp_path, [a, b], shard_bytes=20_000)
    before = len(a.calls)
    weights = tiny_weights(tiny_path, shift=1.0)
    engine.update_weights(iter(weights.items()), version=1)

    v1 = tmp_path / "sync" / "v1"
    for server in (a, b):
        assert server.paths(before) == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
            "/model_info",
        ]
        assert server.calls[before][1] == {"mode": "abort"}
        assert server.calls[before + 1][1] == {"model_path": str(v1), "weight_version": "1", "flush_cache": True}
    shards = sorted(v1.glob("model-*.safetensors"))
    index = json.loads((v1 / "model.safetensors.index.json").read_text())
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    loaded = {name: tensor for shard in shards for name, tensor in load_file(shard).items()}
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert (v1 / "config.json").is_file() and (v1 / "tokenizer.json").is_file()
    model = Qwen3ForCausalLM.from_pretrained(v1)
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])
    assert engine.weight_version == 1 and engine.generate([[5]], [4], UNFILTERED)[0].weight_version == 1

    engine.update_weights(iter(tiny_weights(tiny_path).items()), version=2)
    assert sorted(p.name for p in (tmp_path / "sync").glob("v*")) == ["v2"]  # old versions are deleted


def test_partial_or_foreign_updates_touch_no_server(tiny_path, tmp_path, fake):
    server = fake()
    engine = sglang_engine_for(tiny_path, tmp_path, [server])
    before = len(server.calls)
    weights = tiny_weights(tiny_path)
    weights.pop("lm_head.weight")
    with pytest.raises(RuntimeError, match="missed"):
        engine.update_weights(iter(weights.items()), version=1)
    with pytest.raises(KeyError, match="does not have"):
        engine.update_weights(iter([("not.a.weight", torch.zeros(1))]), version=1)
    assert len(server.calls) == before and engine.weight_version == 0
    assert not list((tmp_path / "sync").glob("*v1*"))


def test_distributed_sync_choreography(tiny_path, tmp_path, fake):
    a, b = fake(), fake()
    groups, broadcasts = [], []

    def init_group(*args):
        groups.append(args)
        return "GROUP"

    engine = sglang_engine_for(
        tiny_path,
        tmp_path,
        [a, b],
        weight_sync="distributed",
        sync_backend="gloo",
        bucket_bytes=30_000,
        init_group=init_group,
        broadcast=lambda tensor, group: broadcasts.append((tensor, group)),
    )
    before = len(a.calls)
    weights = tiny_weights(tiny_path, shift=1.0)
    engine.update_weights(iter(weights.items()), version=1)

    assert groups == [("gloo", "tcp://127.0.0.1:29600", 3, 0, GROUP_NAME)]
    for server, offset in ((a, 1), (b, 2)):
        paths = server.paths(before)
        updates = server.bodies("/update_weights_from_distributed")
        begin = ["/init_weights_update_group", "/pause_generation", "/begin_weight_update"]
        end = ["/end_weight_update", "/continue_generation", "/model_info"]
        assert paths == begin + ["/update_weights_from_distributed"] * len(updates) + end
        assert server.calls[before][1] == {
            "master_address": "127.0.0.1",
            "master_port": 29600,
            "rank_offset": offset,
            "world_size": 3,
            "group_name": GROUP_NAME,
            "backend": "gloo",
        }
        assert len(updates) >= 2 and [u.get("weight_version") for u in updates] == [None] * (len(updates) - 1) + ["1"]
        assert [n for u in updates for n in u["names"]] == list(weights)
        assert [s for u in updates for s in u["shapes"]] == [list(t.shape) for t in weights.values()]
        assert {d for u in updates for d in u["dtypes"]} == {"float32"}
    assert [g for _, g in broadcasts] == ["GROUP"] * len(weights)  # each tensor broadcast once, in stream order
    assert all(torch.equal(sent, w) for (sent, _), w in zip(broadcasts, weights.values()))

    engine.update_weights(iter(weights.items()), version=2)
    assert len(groups) == 1 and a.version == b.version == "2"  # the group is formed once


def test_trainer_side_process_group_broadcasts_to_a_peer(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the peer (a server's rank) runs the same function's source, without importing canopy (and transformers)
    peer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import torch\nfrom datetime import timedelta\n"
                + inspect.getsource(init_custom_process_group)
                + f"g = init_custom_process_group('gloo', 'tcp://127.0.0.1:{port}', 2, 1, 'canopy_test')\n"
                "t = torch.zeros(3); torch.distributed.broadcast(t, src=0, group=g); print(t.tolist(), flush=True)\n"
                # leave without tearing down gloo's threads: at interpreter exit that can abort (seen once under load)
                "import os; os._exit(0)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "canopy_test")
    broadcast_from_trainer(torch.tensor([1.0, 2.0, 3.0]), group)
    out, _ = peer.communicate(timeout=60)
    assert peer.returncode == 0 and out.strip() == "[1.0, 2.0, 3.0]"


def test_agent_loop_quarantines_only_the_episode_whose_request_failed(tiny_path, tokenizer, tmp_path, fake):
    login, im_end = tokenizer.convert_tokens_to_ids("login"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    server = fake(reply_ids=[login, im_end])
    engine = sglang_engine_for(tiny_path, tmp_path, [server], max_retries=1)
    env = EmbeddedEnvironment()
    tasks = [Task(f"vault0_s{s}_t1", 1, "vault0", {"vault": 0, "start": s, "goal_end": s + 1}) for s in (0, 3)]
    server.fail_prefix = render_prompt(tokenizer, env.start(tasks[0], seed=0).messages())
    budget = Budget(
        max_turns=2, max_response_tokens=64, max_prompt_tokens=128, max_observation_tokens=32, max_context_tokens=512
    )
    failed, served = run_episodes(
        engine,
        env,
        tokenizer,
        [(tasks[0], 0), (tasks[1], 1)],
        budget,
        UNFILTERED,
    )[0]
    assert (failed.ending, failed.quarantine, failed.verdict) == ("quarantined", "engine_request_failed", None)
    assert served.quarantine is None and served.verdict is not None and served.weight_versions == {0}


def test_launch_command_for_the_enlarged_budget():
    settings = SGLangSettings(
        python="/venv/bin/python", base_port=31000, base_gpu_id=1, tp_size=2, extra_args=["--dtype", "bfloat16"]
    )
    yarn = {"rope_type": "yarn", "factor": 1.5, "original_max_position_embeddings": 40960}
    argv, env = launch_command(settings, "/models/q", 1, 61440, yarn, seed=3)
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"] and argv[-2:] == ["--dtype", "bfloat16"]
    assert (flags["--port"], flags["--base-gpu-id"], flags["--tp-size"]) == ("31001", "3", "2")
    assert flags["--context-length"] == "61440"
    assert (flags["--model-path"], flags["--weight-version"], flags["--random-seed"]) == ("/models/q", "0", "4")
    assert json.loads(flags["--json-model-override-args"]) == {"rope_scaling": yarn}
    assert env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    assert "--json-model-override-args" not in launch_command(settings, "/models/q", 0, 40960, None, seed=0)[0]


def test_a_server_that_dies_at_startup_reports_its_log(tiny_path, tmp_path):
    with pytest.raises(RuntimeError, match=r"exited with code 1.*server_39999\.log:\n.*No module named 'sglang'"):
        SGLangEngine(tiny_path, STOPS, SGLangSettings(python=sys.executable, sync_dir=str(tmp_path), base_port=39999))


def test_engine_config_validation_and_build(tiny_path, tokenizer, tmp_path, fake, monkeypatch):
    monkeypatch.delenv("CANOPY_SGLANG_PYTHON", raising=False)
    validate(config())  # the embedded default (local engine) does not look at engine.sglang
    with pytest.raises(ConfigError, match="engine.sglang.python is not set"):
        validate(config("engine.name=sglang"))
    server = fake()
    attach = ["engine.name=sglang", f"engine.sglang.urls=['{server.url}']", f"engine.sglang.sync_dir={tmp_path}"]
    validate(config(*attach))
    with pytest.raises(ConfigError, match="weight_sync='rsync' is unknown"):
        validate(config(*attach, "engine.sglang.weight_sync=rsync"))
    with pytest.raises(ConfigError, match="set trainer.accelerator=gpu"):
        validate(config(*attach, "engine.sglang.weight_sync=distributed"))
    monkeypatch.setenv("CANOPY_SGLANG_PYTHON", "/opt/sglang/bin/python")
    assert config("engine.name=sglang").engine.sglang.python == "/opt/sglang/bin/python"
    engine = build_engine(config(*attach), str(tiny_path), tokenizer)
    assert (
        isinstance(engine, SGLangEngine)
        and engine.fleet.servers[0].url == server.url
        and engine.stop_token_ids == [0, 2]
    )


def test_servers_and_trainer_never_share_gpus_and_remote_servers_reach_rank_0():
    """Launched servers go on GPUs after the trainer's (design/scale.md defect 9); servers on other machines get a
    non-loopback address for the weight-sync group and launched ones bind where they are told."""
    gpu = ["engine.name=sglang", "engine.sglang.python=/x", "trainer.accelerator=gpu", "engine.sglang.num_servers=2"]
    with pytest.raises(ConfigError, match=r"on GPUs 0-1, but the trainer uses GPU 0 .*base_gpu_id=1 "):
        validate(config(*gpu))
    with pytest.raises(ConfigError, match=r"on GPUs 2-5, but the trainer uses GPUs 0-3"):
        validate(
            config(
                *gpu,
                "engine.sglang.tp_size=2",
                "engine.sglang.base_gpu_id=2",
                "trainer.devices=4",
                "parallelism.dp_shard=4",
            )
        )
    validate(config(*gpu, "engine.sglang.base_gpu_id=4", "trainer.devices=4", "parallelism.dp_shard=4"))
    for experiment in ("appworld_canopy", "swebench_canopy"):  # one 8-GPU node: trainer on 0-3, servers on 4-7
        cfg = config(f"experiment={experiment}", "engine.sglang.python=/x")
        SGLangSettings(**cfg.engine.sglang).validate(cfg.trainer.accelerator, cfg.trainer.devices)

    remote = [
        "engine.name=sglang",
        "engine.sglang.urls=[http://10.1.2.3:30000]",
        "engine.sglang.weight_sync=distributed",
        "engine.sglang.sync_backend=gloo",
    ]
    with pytest.raises(ConfigError, match="sync_master_addr=127.0.0.1 is a loopback address, but the servers"):
        validate(config(*remote))
    validate(config(*remote, "engine.sglang.sync_master_addr=10.1.2.4"))
    validate(
        config(
            "engine.name=sglang",
            "engine.sglang.urls=[http://localhost:30000]",
            "engine.sglang.weight_sync=distributed",
            "engine.sglang.sync_backend=gloo",
        )
    )

    with pytest.raises(ConfigError, match="engine.sglang.router_url=gateway:30080: must be null or the gateway's URL"):
        validate(config(*remote, "engine.sglang.sync_master_addr=10.1.2.4", "engine.sglang.router_url=gateway:30080"))

    settings = SGLangSettings(python="/x", host="0.0.0.0")
    argv, _ = launch_command(settings, "/models/q", 0, None, None, seed=0)
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and client_host("0.0.0.0") == "127.0.0.1"
    assert client_host("10.1.2.4") == "10.1.2.4"


def budget_transfer(tmp_path, engine, tokenizer, every_n_steps=0):
    """The budget-transfer callback lent `engine`, with short budgets, and a trainer / module stand-in at step 5."""
    cfg = config("budget@eval.enlarged=enlarged")
    run_config = OmegaConf.create({k: cfg[k] for k in ("seed", "budget", "sampling")})
    run_config.budget.max_turns = 2
    callback = BudgetTransferEval(run_config, cfg.eval.enlarged, split="test", every_n_steps=every_n_steps)
    callback.configs["enlarged_budget"].budget.max_turns = 2  # the enlarged budget keeps its YaRN and 61,440 tokens
    datamodule = SimpleNamespace(engine=engine, env=EmbeddedEnvironment(), tokenizer=tokenizer, trajectory_log=None)
    datamodule.max_quarantine_fraction = 0.5
    trainer = SimpleNamespace(global_step=5, is_global_zero=True, world_size=1, loggers=[], datamodule=datamodule)
    trainer.default_root_dir = str(tmp_path)
    return callback, trainer


def test_budget_transfer_evaluates_on_the_training_servers_and_never_resets_attached_ones(
    tiny_path, tokenizer, tmp_path, fake
):
    """Defect 1 of design/scale.md: evaluation used to build a second engine, which reset attached servers to the
    base weights (or launched a second set on the same ports). Now it borrows the run's engine."""
    server = fake()
    engine = sglang_engine_for(tiny_path, tmp_path, [server])
    engine.update_weights(tiny_weights(tiny_path, 0.01).items(), 5)
    before = len(server.calls)
    callback, trainer = budget_transfer(tmp_path, engine, tokenizer, every_n_steps=5)
    with pytest.warns(RuntimeWarning, match=r"enlarged \(2t/61440\) evaluation is left by evaluate.py"):
        callback.on_train_batch_end(trainer, SimpleNamespace(weight_version=5), None, None, 0)
    assert [r["role"] for r in callback.last[1]] == ["training_budget"]
    callback.on_train_end(trainer, SimpleNamespace(weight_version=5))  # attached: never relaunched, said once
    assert set(server.paths(before)) == {"/generate"}  # no reset, no weight update, no second server
    assert engine.weight_version == 5 and {b["weight_version"] for b in server.bodies("/update_weights_from_disk")} == {
        "0",
        "5",
    }


def test_budget_transfer_relaunches_launched_servers_at_the_enlarged_budget_then_back(
    tiny_path, tokenizer, tmp_path, monkeypatch
):
    """Servers the engine launched serve the enlarged budget (YaRN, 61,440 tokens) only after training: relaunched
    on the same port with those settings and the final weights, then relaunched as they were."""
    from tests.parallel_worker import free_port

    launches = tmp_path / "launches.jsonl"
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests' / 'fake_sglang_launch'}:{ROOT}")
    monkeypatch.setenv("FAKE_SGLANG_LAUNCHES", str(launches))
    settings = SGLangSettings(python=sys.executable, sync_dir=str(tmp_path / "sync"), base_port=free_port())
    engine = SGLangEngine(tiny_path, STOPS, settings, context_length=1024, retry_backoff_s=0.0)
    try:
        weights = tiny_weights(tiny_path, 0.01)
        engine.update_weights(weights.items(), 5)
        callback, trainer = budget_transfer(tmp_path, engine, tokenizer, every_n_steps=5)
        module = SimpleNamespace(weight_version=5, iter_hf_weights=lambda: iter(weights.items()))
        with pytest.warns(RuntimeWarning, match="evaluation is left at the end of training"):
            callback.on_train_batch_end(trainer, module, None, None, 0)
        assert len(launches.read_text().splitlines()) == 1  # nothing relaunched during training
        callback.on_train_end(trainer, module)
        flags = [dict(zip(a[::2], a[1::2])) for a in map(json.loads, launches.read_text().splitlines())]
        assert len(flags) == 3 and flags[0]["--port"] == flags[1]["--port"] == flags[2]["--port"]
        assert flags[0]["--context-length"] == "1024" and "--json-model-override-args" not in flags[0]
        assert flags[1]["--context-length"] == "61440"
        assert json.loads(flags[1]["--json-model-override-args"])["rope_scaling"]["rope_type"] == "yarn"
        assert flags[2] == flags[0]
        assert (engine.weight_version, engine.rope_scaling, engine.context_length) == (5, None, 1024)
        results = json.loads((tmp_path / "budget_transfer.json").read_text())
        assert [r["role"] for r in results] == ["training_budget", "enlarged_budget"]
    finally:
        engine.close()


def test_serving_dtype_follows_sglangs_dtype_rule(tiny_path, tmp_path):
    """The audit's gap bounds are chosen by the dtype the servers compute in, known without launching them."""
    assert serving_dtype([], tiny_path) == "float16"  # "auto" serves a float32 checkpoint in float16
    assert serving_dtype(["--dtype", "bfloat16"], tiny_path) == "bfloat16"
    assert serving_dtype(["--mem-fraction-static", "0.5", "--dtype", "half"], tiny_path) == "float16"
    assert serving_dtype(["--dtype", "auto"], tiny_path) == "float16"
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert serving_dtype([], bf16) == "bfloat16"
    (bf16 / "config.json").write_text(json.dumps({}))
    assert serving_dtype([], bf16) == "bfloat16"


@pytest.mark.parametrize(
    "overrides, dtype",
    [
        (["engine=sglang"], "float16"),  # "auto" on the float32 checkpoint
        (["engine=sglang", "engine.sglang.extra_args=[--dtype,bfloat16]"], "bfloat16"),
        (["engine=vllm", "engine.vllm.dtype=bfloat16"], "bfloat16"),
        (["engine.local.dtype=bfloat16"], "bfloat16"),
    ],
)
def test_the_runs_engine_handle_knows_each_engines_dtype_before_building_it(tiny_path, overrides, dtype):
    """train.py's engine handle carries the dtype the chosen engine will compute in (the audit's gap bounds are
    chosen by it), from the settings alone: nothing is launched or loaded."""
    from canopy.build import build_engine_handle

    handle = build_engine_handle(config(*overrides), tiny_path)
    assert handle.dtype == dtype and handle.version == 0
