"""VLLMEngine against fake vLLM servers (stdlib, in a thread): attach, request bodies and reply parsing, aborted and
stale samples, the disk weight sync's order of calls, a server failing its sync ejected and re-synced when it answers
again, the NCCL weight transfer's choreography over fake groups (what each server is told and what it receives, a
server failing mid-transfer aborted and rejoining, a server without weight transfer refused at start), launch
commands, and the settings' one-line errors. Real servers: tests/test_vllm_server.py."""

import json
import time
from pathlib import Path

import pytest
import torch
from fake_vllm import FakeTransport, FakeVLLM
from omegaconf import OmegaConf
from safetensors.torch import load_file

from canopy.config import compose_config, validate
from canopy.errors import ConfigError
from canopy.rollout.engine import EngineFault, SamplingParams
from canopy.rollout.http.routing import StaleSampleError
from canopy.rollout.vllm import VLLMSettings
from canopy.rollout.vllm.servers import launch_command
from tests.helpers import UNFILTERED, tiny_weights, vllm_engine_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake():
    servers = []

    def make(**kwargs):
        servers.append(FakeVLLM(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def test_attach_reloads_the_base_weights_as_version_0_then_generates(tiny_path, tmp_path, fake):
    server = fake()
    engine = vllm_engine_for(tiny_path, tmp_path, [server])
    assert server.paths() == ["/health", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                              "/weight_info"]  # fmt: skip
    assert server.calls[1].body == {"method": "reload_weights", "kwargs": {"weights_path": str(Path(tiny_path))}}
    assert server.calls[3].body == {"new_version": "0"}

    stop, cut, empty = engine.generate(
        [[5, 6, 7], [5, 6], [5]], [10, 1, 0], SamplingParams(temperature=0.7, top_p=1.0, top_k=-1)
    )
    assert (stop.token_ids, stop.logprobs) == ([7, 8, 2], [-0.25, -0.5, -0.75])
    assert (stop.finish_reason, stop.weight_version) == ("stop", 0)
    assert (cut.token_ids, cut.finish_reason) == ([7], "length")
    assert (empty.token_ids, empty.finish_reason) == ([], "length")  # nothing left to generate: no request
    body = sorted(server.bodies("/inference/v1/generate"), key=lambda b: len(b["token_ids"]))[1]
    assert body == {
        "token_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 10, "stop_token_ids": [0, 2],
                            "logprobs": 0, "skip_special_tokens": False},
    }  # fmt: skip
    engine.close()


def test_aborted_requests_are_retried_and_failing_ones_quarantined(tiny_path, tmp_path, fake):
    server = fake()
    engine = vllm_engine_for(tiny_path, tmp_path, [server])
    server.failures = ["abort", "500"]
    [ok] = engine.generate([[5]], [4], UNFILTERED)
    assert ok.token_ids == [7, 8, 2] and len(server.bodies("/inference/v1/generate")) == 3
    server.failures = ["500"] * 3
    [fault] = engine.generate([[5]], [4], UNFILTERED)
    assert isinstance(fault, EngineFault) and fault.reason == "engine_request_failed"
    server.failures = ["400"]
    with pytest.raises(RuntimeError, match="rejected a /inference/v1/generate request"):
        engine.generate([[5]], [4], UNFILTERED)
    engine.close()


def test_a_sample_from_other_weights_is_refused(tiny_path, tmp_path, fake):
    server = fake()
    engine = vllm_engine_for(tiny_path, tmp_path, [server], max_retries=1)
    server.version = "default"  # restarted behind the engine's back
    with pytest.raises(StaleSampleError, match=r"version\(s\) \['default'\] but the engine holds 0"):
        engine.generate([[5]], [4], UNFILTERED)
    mixed = {"choices": [{"finish_reason": "length", "token_ids": [3, 4],
                          "weight_versions": [{"version": "0", "start": 0, "end": 1},
                                              {"version": "1", "start": 1, "end": 2}],
                          "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -1.0}]}}]}  # fmt: skip
    with pytest.raises(StaleSampleError):  # a pause with mode=keep let the request span two versions
        engine.backend.parse(mixed, 0)
    mixed["choices"][0]["weight_versions"] = [{"version": "0", "start": 0, "end": 2}]
    mixed["choices"][0]["logprobs"]["content"].pop()
    with pytest.raises(RuntimeError, match="2 tokens but 1 logprobs"):
        engine.backend.parse(mixed, 0)
    engine.close()


def test_disk_sync_writes_a_loadable_checkpoint_and_drives_every_server_in_order(tiny_path, tmp_path, fake):
    a, b = fake(), fake()
    engine = vllm_engine_for(tiny_path, tmp_path, [a, b])
    since = len(a.calls)
    engine.update_weights(tiny_weights(tiny_path, 0.5).items(), 1)
    path = tmp_path / "sync" / "v1"
    for server in (a, b):
        assert server.paths(since) == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                                       "/resume", "/weight_info"]  # fmt: skip
        assert server.calls[since].query == {"mode": "abort", "clear_cache": "true"}
        assert server.weights_path == str(path) and server.version == "1"
    written = load_file(path / "model-00001.safetensors")
    base = tiny_weights(tiny_path)
    assert written.keys() == base.keys() and all((written[k] - base[k] - 0.5).abs().max() < 1e-6 for k in base)
    assert json.loads((path / "config.json").read_text())["head_dim"] > 0
    engine.update_weights(tiny_weights(tiny_path, 0.7).items(), 2)
    assert [p.name for p in (tmp_path / "sync").glob("v*")] == ["v2"]  # the older version is gone
    with pytest.raises(RuntimeError, match="missed"):  # every weight, or none
        engine.update_weights(list(tiny_weights(tiny_path).items())[:-1], 3)
    engine.close()


def test_a_server_failing_its_sync_is_ejected_then_resynced_before_it_serves(tiny_path, tmp_path, fake):
    a, b = fake(), fake()
    engine = vllm_engine_for(tiny_path, tmp_path, [a, b])
    b.fail_control = {"/collective_rpc"}
    engine.update_weights(tiny_weights(tiny_path, 0.1).items(), 1)  # a takes it; b is ejected, not the run stopped
    assert a.version == "1" and b.version == "0" and engine.fleet.servers[1].ejected
    before = len(b.bodies("/inference/v1/generate"))
    engine.generate([[5]] * 4, [4] * 4, UNFILTERED, keys=["x", "y", "z", "w"])
    assert len(b.bodies("/inference/v1/generate")) == before  # an ejected server serves nothing
    b.fail_control = set()  # it answers again: found on other weights, re-synced from v1, re-admitted
    deadline = time.monotonic() + 10
    while engine.fleet.servers[1].ejected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.version == "1" and b.weights_path == str(tmp_path / "sync" / "v1")
    counts = engine.router.counts
    assert counts["stale_refusals"] >= 1 and counts["resyncs"] == 1 and counts["readmissions"] == 1
    a.fail_control = b.fail_control = {"/collective_rpc"}
    with pytest.raises(RuntimeError, match="no vLLM server took weight version 2"):
        engine.update_weights(tiny_weights(tiny_path, 0.2).items(), 2)
    engine.close()


def nccl_engine(tiny_path, tmp_path, fake, count=2, **overrides):
    transport = FakeTransport()
    servers = [fake(transport=transport) for _ in range(count)]
    overrides = {"weight_sync": "nccl", "bucket_mib": 0.01, **overrides}  # 10 KiB buckets: several per update
    return vllm_engine_for(tiny_path, tmp_path, servers, transport, **overrides), servers, transport


def test_nccl_sync_sends_every_weight_in_the_order_each_server_was_told(tiny_path, tmp_path, fake):
    engine, (a, b), transport = nccl_engine(tiny_path, tmp_path, fake)
    for server in (a, b):  # a group with each server at start, from a unique id of the trainer's
        [init] = server.bodies("/init_weight_transfer_engine")
        assert init["init_info"]["world_size"] == 2 and init["init_info"]["packed"] is False
    assert len(transport.groups) == 2
    since = len(a.calls)
    weights = tiny_weights(tiny_path, 0.25)
    engine.update_weights(weights.items(), 1)
    for server in (a, b):
        paths = server.paths(since)
        buckets = paths.count("/update_weights")
        assert buckets >= 3  # the tiny model in 10 KiB buckets
        assert paths == ["/pause", "/start_weight_update", *["/update_weights"] * buckets, "/finish_weight_update",
                         "/reset_prefix_cache", "/resume", "/weight_info"]  # fmt: skip
        assert server.calls[since].query == {"mode": "abort", "clear_cache": "true"}
        assert server.bodies("/finish_weight_update") == [{"weight_version": "1"}] and server.version == "1"
        told = [name for body in server.bodies("/update_weights") for name in body["update_info"]["names"]]
        assert sorted(told) == sorted(weights) and len(told) == len(weights)  # each weight once
        assert all(torch.equal(server.weights[name], weights[name]) for name in weights)  # what it was sent
    [stop] = engine.generate([[5, 6]], [4], UNFILTERED)
    assert stop.weight_version == 1
    with pytest.raises(RuntimeError, match="missed"):  # a stream that breaks off leaves every server suspect
        engine.update_weights(list(tiny_weights(tiny_path).items())[:-1], 2)
    assert all(server.ejected for server in engine.fleet.servers) and not engine.weight_sync.groups
    engine.close()


def test_a_server_failing_mid_transfer_is_aborted_ejected_and_rejoins_at_the_next_step(tiny_path, tmp_path, fake):
    engine, (a, b), transport = nccl_engine(tiny_path, tmp_path, fake)
    first_group = engine.weight_sync.groups[engine.fleet.servers[1]][0]
    b.fail_control = {"/update_weights"}  # b's workers never take the bucket: the broadcast into its group waits
    engine.update_weights(tiny_weights(tiny_path, 0.1).items(), 1)  # until the group is aborted; a takes it
    assert first_group.aborted and a.version == "1" and b.version == "0" and engine.fleet.servers[1].ejected
    assert engine.router.counts["ejections"] == 1
    b.fail_control = set()  # it answers again: not re-synced alone (no copy of the weights), it waits for the next step
    engine.update_weights(tiny_weights(tiny_path, 0.2).items(), 2)
    assert b.bodies("/shutdown_weight_transfer_engine")[-1] == {} and len(b.bodies("/init_weight_transfer_engine")) == 2
    assert a.version == b.version == "2" and len(transport.groups) == 3  # b over a new group
    assert all(torch.equal(b.weights[k], v) for k, v in tiny_weights(tiny_path, 0.2).items())
    deadline = time.monotonic() + 10
    while engine.fleet.servers[1].ejected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.router.counts["readmissions"] == 1 and engine.router.counts["resyncs"] == 0
    a.fail_control = b.fail_control = {"/start_weight_update"}
    with pytest.raises(RuntimeError, match="no vLLM server took weight version 3 over NCCL"):
        engine.update_weights(tiny_weights(tiny_path, 0.3).items(), 3)
    engine.close()


def test_a_server_without_weight_transfer_stops_the_engine_at_start_naming_the_flag(tiny_path, tmp_path, fake):
    server = fake()  # launched without --weight-transfer-config: it refuses /init_weight_transfer_engine
    with pytest.raises(RuntimeError, match=r"weight_transfer_config.*--weight-transfer-config .*weight_sync=disk"):
        vllm_engine_for(tiny_path, tmp_path, [server], FakeTransport(), weight_sync="nccl")
    assert server.paths()[-1] == "/init_weight_transfer_engine"


def test_launch_commands_serve_the_trainers_logprobs_and_keep_off_home(tmp_path):
    settings = VLLMSettings(python="/venv/bin/python", sync_dir=str(tmp_path), base_port=31000, threads=2)
    argv, env = launch_command(settings, "/models/m", 1, 1024, None, 7)
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--port"] == "31001" and flags["--seed"] == "8" and flags["--dtype"] == "float32"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert argv[argv.index("--max-num-batched-tokens") + 1] == argv[argv.index("--max-model-len") + 1] == "1024"
    assert "--no-enable-chunked-prefill" in argv and "--enforce-eager" in argv and "--enable-scale-out" in argv
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path)) and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    argv, env = launch_command(VLLMSettings(python="p", device="cuda", tp_size=2, base_gpu_id=2), "/m", 1, 8192,
                               yarn, 0)  # fmt: skip
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {"rope_scaling": yarn}
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and "--enforce-eager" not in argv
    assert "--weight-transfer-config" not in argv
    argv, _ = launch_command(VLLMSettings(python="p", device="cuda", weight_sync="nccl"), "/m", 0, 8192, None, 0)
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}


@pytest.mark.parametrize(
    "override, message",
    [
        ("engine.vllm.python=null", "engine.vllm.python is not set: run `make vllm`"),
        ("engine.vllm.device=tpu", "engine.vllm.device='tpu' is unknown: use cpu or cuda"),
        ("engine.vllm.dtype=float16", "float16 is not served by vLLM's CPU build"),
        ("engine.vllm.block_size=48", "block_size=48: vLLM's CPU attention takes multiples of 32"),
        ("engine.vllm.weight_sync=nccl", "weight_sync=nccl broadcasts from the trainer's GPU .*use .*weight_sync=disk"),
        ("engine.vllm.weight_sync=ipc", "weight_sync='ipc' is unknown: use disk or nccl"),
        ("engine.vllm.bucket_mib=0", r"engine.vllm.bucket_mib=0(\.0)? must be > 0 MiB"),
        ("engine.vllm.kv_cache_gib=0", "engine.vllm.kv_cache_gib=0 must be a positive integer"),
        ("sampling.top_k=20", "top_k=20 / top_p=1.0 are the filtered distribution's"),
    ],
)
def test_bad_settings_stop_before_anything_starts_in_one_line(override, message):
    cfg = compose_config(["experiment=embedded_vllm", override])
    with pytest.raises(ConfigError, match=message) as error:
        validate(cfg)
    assert "\n" not in str(error.value)


def test_the_embedded_default_on_vllm_composes_with_a_servable_tiny_model():
    cfg = compose_config(["experiment=embedded_vllm"])
    validate(cfg)
    assert cfg.engine.name == "vllm" and cfg.engine.vllm.num_servers == 2
    assert cfg.model.tiny.hidden_size // cfg.model.tiny.heads == 32  # vLLM's CPU attention refuses head_dim 16
    assert "-h2-" in cfg.model.tiny.dir  # apart from the local engine's default tiny model
    assert OmegaConf.to_container(cfg.engine.gap_bounds)["float32"]["stop"] > 0
