"""Canopy's SGLang client against the SGLang release the Makefile pins (SGLANG_VERSION), read from its source by
tests/sglang_contract.py. What Canopy sends is collected from its own code: the real SGLangEngine driven against fake
servers through each of its paths (attach, generation, ejection and re-admission, disk and distributed weight sync),
and the launch commands `launch_command` builds for every configuration that launches servers. Each request must
name a route the release serves under its method, with fields of the route's request type (and sampling params
/generate admits); each flag must be a server argument, each variable one the release declares. The fake's route
table must be exactly the routes Canopy calls, and a misspelt route, field, flag or variable must be reported."""

import ast
import json
import shlex
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fake_sglang import ROUTES, FakeSGLang
from omegaconf import OmegaConf
from sglang_contract import (
    Failure,
    SGLangSourceMissing,
    check_launch,
    check_reply,
    check_requests,
    check_route,
    load_api,
)

from canopy.rollout import http, sglang
from canopy.rollout.engine import SamplingParams
from canopy.rollout.http import fleet as http_fleet
from canopy.rollout.http import routing as http_routing
from canopy.rollout.sglang import SGLangSettings
from canopy.rollout.sglang import servers as sglang_servers
from tests.helpers import UNFILTERED, config, sglang_engine_for, tiny_weights

ROOT = Path(__file__).resolve().parents[1]


def release():
    """The pinned release's API; a test fails (in one line naming the make target) when its source is not installed."""
    try:
        return load_api()
    except SGLangSourceMissing as missing:
        message = str(missing)
    pytest.fail(message, pytrace=False)


def canopy_requests(tiny_path, work: Path, routes=ROUTES) -> list:
    """Every request SGLangEngine sends to its servers (`fake_http.Call`s), driven through each of its paths
    against two fakes with this route table: attach (health, reset to the base weights, version check), generation
    at the sampling Canopy uses, a failing server ejected and re-admitted (/health), disk weight sync, and two
    distributed weight syncs (the group is formed once; its process group and broadcasts stubbed: no NCCL here)."""
    servers = [FakeSGLang(routes=routes), FakeSGLang(routes=routes)]
    try:
        engine = sglang_engine_for(tiny_path, work / "disk", servers)
        engine.router.health_interval_s = 0.01
        run = OmegaConf.to_container(config().sampling)
        sampling = SamplingParams(**{k: run[k] for k in ("temperature", "top_p", "top_k")})
        engine.generate([[5, 6, 7], [5, 6]], [10, 1], sampling, keys=["e0", "e1"])
        for server in servers:
            server.failures = ["500"]  # both fail once: ejected, retried, re-admitted once /health answers
        engine.generate([[5]], [4], UNFILTERED, keys=["e2"])
        deadline = time.monotonic() + 10
        while engine.router.counts["readmissions"] < engine.router.counts["ejections"] and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.update_weights(tiny_weights(tiny_path, 0.01).items(), 1)
        engine.generate([[5, 6]], [4], sampling, keys=["e0"])
        engine.close()
        engine = sglang_engine_for(
            tiny_path,
            work / "distributed",
            servers,
            weight_sync="distributed",
            sync_backend="gloo",
            bucket_bytes=30_000,
            init_group=lambda *args: "GROUP",
            broadcast=lambda tensor, group: None,
        )
        for version in (1, 2):
            engine.update_weights(tiny_weights(tiny_path, 0.01 * version).items(), version)
        engine.close()
    finally:
        for server in servers:
            server.stop()
    return [call for server in servers for call in server.calls]


def canopy_launches() -> list[tuple[str, list[str], dict[str, str]]]:
    """(source, argv, env) of each way Canopy launches a server: `launch_command` at the training budget and at the
    enlarged one (YaRN), under the default engine.sglang, each experiment's, and scripts/gpu_check_sglang.py's
    default --extra-args."""
    settings = {"conf/train.yaml": config("engine.sglang.python=/x")}
    for experiment in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        if "sglang:" in experiment.read_text():
            cfg = config(f"experiment={experiment.stem}", "engine.sglang.python=/x")
            settings[f"conf/experiment/{experiment.name}"] = cfg
    launches = []
    for source, cfg in settings.items():
        for budget in (cfg.budget, cfg.eval.enlarged.budget):
            rope = OmegaConf.to_container(budget.rope_scaling) if budget.get("rope_scaling") else None
            argv, env = sglang_servers.launch_command(
                SGLangSettings(**cfg.engine.sglang), "/models/m", 1, budget.max_context_tokens, rope, cfg.seed
            )
            launches.append((f"{source} ({budget.name} budget)", argv, env))
    script = ast.parse((ROOT / "scripts" / "gpu_check_sglang.py").read_text())
    [extra] = [
        next(k.value.value for k in call.keywords if k.arg == "default")
        for call in ast.walk(script)
        if isinstance(call, ast.Call) and call.args and getattr(call.args[0], "value", None) == "--extra-args"
    ]
    gpu_check = SGLangSettings(python="/x", extra_args=extra.split())
    launches.append(("scripts/gpu_check_sglang.py", *sglang_servers.launch_command(gpu_check, "/m", 0, None, None, 0)))
    return launches


@pytest.fixture(scope="module")
def sent(tiny_path, tmp_path_factory):
    return canopy_requests(tiny_path, tmp_path_factory.mktemp("contract"))


def test_the_contract_reads_the_release():
    """Not vacuous: what the parse finds includes what is known to be in sglang 0.5.23."""
    api = release()
    assert check_route(api, "POST", "/generate")[0].body == "GenerateReqInput"
    assert check_route(api, "GET", "/health")[0].handler == check_route(api, "GET", "/health_generate")[0].handler
    assert {m for r in api.routes_at("/flush_cache") for m in r.methods} == {"GET", "POST"}
    assert check_route(api, "POST", "/v1/models/x")[1] and check_route(api, "GET", "/v1/models/x")[0]  # templates
    assert len(api.routes) > 50
    disk = api.requests["UpdateWeightFromDiskReqInput"]
    assert disk["model_path"].required and not disk["weight_version"].required and "rid" in disk  # BaseReq's
    assert {"temperature", "top_k", "max_new_tokens"} <= set(api.sampling_params)
    assert "stop_strs" not in api.sampling_params  # an internal field of the server's SamplingParams
    assert {"--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--config"} <= set(api.flags)
    assert api.flags["--model-path"] is True and api.flags["--trust-remote-code"] is False and len(api.flags) > 400
    assert api.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "EnvBool" and {"false", "1"} <= api.env_bool_values
    assert api.finish_reasons == {"stop": "FinishStop", "length": "FinishLength", "abort": "FinishAbort"}
    assert list(api.schema["LogprobEntry"]) == ["logprob", "token_id", "text"]  # as SGLangEngine.parse reads them
    assert {"weight_version", "model_path"} <= api.model_info
    # and it reports what is wrong
    assert check_requests(api, [("POST", "/generate", {"input_ids": [1], "sampling_params": {"top_k": "20"}})]) == [
        Failure("wrong_type", "POST /generate sampling_params top_k", "'20' is not Optional[int] (SamplingParams)")
    ]
    assert [f.kind for f in check_requests(api, [("POST", "/pause_generation", {"mode": "halt"})])] == ["wrong_type"]
    assert [f.kind for f in check_requests(api, [("POST", "/update_weights_from_disk", {})])] == ["missing_field"]
    assert [f.kind for f in check_requests(api, [("POST", "/flush_cache", {"all": True})])] == ["unexpected_body"]
    assert [f.kind for f in check_launch(api, ["--trust-remote-code", "1", "--port"], {})] == [
        "flag_takes_no_value",
        "flag_needs_value",
    ]
    reply = {
        "meta_info": {"weight_verison": "0", "finish_reason": {"type": "done"}, "output_token_logprobs": [[7, -1]]}
    }
    assert {(f.kind, f.where) for f in check_reply(api, "/generate", reply)} == {
        ("unknown_reply_field", "/generate meta_info weight_verison"),
        ("unknown_finish_reason", "/generate finish_reason"),
        ("wrong_type", "/generate output_token_logprobs"),
    }
    assert [f.kind for f in check_reply(api, "/model_info", {"version": "0"})] == ["unknown_reply_field"]


def test_every_request_canopy_sends_is_served_by_the_release(sent):
    api = release()
    failures = check_requests(api, [(call.method, call.path, call.body) for call in sent])
    assert not failures, f"sglang {api.version}:\n" + "\n".join(map(str, failures))
    assert {call.status for call in sent} == {200, 500}  # the fakes answered every route (500: the scripted one)
    # the collection drove every route the engine's code names
    packages = [Path(sglang.__file__).parent, Path(http.__file__).parent]  # the backend and the core it runs on
    sources = [ast.parse(path.read_text()) for package in packages for path in package.glob("*.py")]
    named = {
        n.value
        for source in sources
        for n in ast.walk(source)
        if isinstance(n, ast.Constant) and str(n.value).startswith("/")
    }
    named = {path for path in named if path[1:].replace("_", "").isalpha()}
    assert named == {call.path for call in sent}


def test_every_flag_and_variable_canopy_launches_with_is_the_release():
    api = release()
    launches = canopy_launches()
    assert any("--json-model-override-args" in argv for _, argv, _ in launches)  # the YaRN branch was taken
    failures = [f"{source}: {f}" for source, argv, env in launches for f in check_launch(api, argv, env)]
    assert not failures, f"sglang {api.version}:\n" + "\n".join(failures)


def test_the_documented_launch_commands_name_real_flags():
    """The launch commands the README's and docs/' code blocks spell out for servers started by hand (values are
    shell: flags only)."""
    api = release()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [block for page in pages for block in page.read_text().split("```")[1::2]]
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    commands = [line for line in lines if "sglang.launch_server" in line]
    assert commands
    for command in commands:
        tokens = shlex.split(command.split("sglang.launch_server", 1)[1].split(">")[0])
        env = dict(t.split("=", 1) for t in shlex.split(command.split("sglang.launch_server")[0]) if "=" in t)
        failures = check_launch(api, [t for t in tokens if t.startswith("--")], env, values=False)
        assert not failures, "\n".join(map(str, failures))


def _status(url: str, method: str) -> int:
    data = b"{}" if method != "GET" else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_fake_serves_exactly_the_routes_canopy_calls_as_the_release_does(sent):
    api = release()
    assert {(call.method, call.path) for call in sent} == ROUTES
    for method, path in sorted(ROUTES):
        assert check_route(api, method, path)[1] == []
    # its replies to what Canopy parses (/generate, /model_info) are ones the release gives
    replies = [call for call in sent if call.status == 200 and call.path in ("/generate", "/model_info")]
    assert {call.path for call in replies} == {"/generate", "/model_info"}
    failures = list(dict.fromkeys(f for call in replies for f in check_reply(api, call.path, call.reply)))
    assert not failures, "\n".join(map(str, failures))
    assert {call.reply["meta_info"]["finish_reason"]["type"] for call in replies if call.path == "/generate"} == {
        "stop",
        "length",
    }
    fake = FakeSGLang()
    try:  # anything else is answered as FastAPI would
        assert _status(fake.url + "/update_weight_from_disk", "POST") == 404
        assert _status(fake.url + "/generate", "GET") == 405 and _status(fake.url + "/model_info", "POST") == 405
        assert _status(fake.url + "/health", "GET") == 200
    finally:
        fake.stop()


def test_misspelt_routes_fields_flags_and_variables_are_reported(tiny_path, tmp_path, monkeypatch):
    """Mutations of what the engine sends, at its HTTP call and its launch command: the contract names each."""
    api = release()
    request = http_fleet.request

    def misspelt(url, body, timeout, headers=None, method=None):
        url = url.replace("/update_weights_from_disk", "/update_weight_from_disk")
        if url.endswith("/model_info"):
            body = {}  # POST instead of GET
        body = json.loads(json.dumps(body))  # the engine's own bodies stay as they are
        if body and "rank_offset" in body:
            body["rank_ofset"] = body.pop("rank_offset")
        if body and body.get("weight_version") and "names" in body:
            body["weight_version"] = int(body["weight_version"])
        if body and "sampling_params" in body:
            body["sampling_params"]["no_stop_trimming"] = body["sampling_params"].pop("no_stop_trim")
        return request(url, body, timeout, headers, method)

    for module in (http_fleet, http_routing):  # each module that sends requests
        monkeypatch.setattr(module, "request", misspelt)
    calls = canopy_requests(tiny_path, tmp_path, routes=None)  # fakes that answer anything: the contract must tell
    found = {(f.kind, f.where) for f in check_requests(api, [(c.method, c.path, c.body) for c in calls])}
    assert found == {
        ("unknown_route", "POST /update_weight_from_disk"),
        ("wrong_method", "POST /model_info"),
        ("unknown_field", "POST /init_weights_update_group rank_ofset"),
        ("missing_field", "POST /init_weights_update_group rank_offset"),
        ("wrong_type", "POST /update_weights_from_distributed weight_version"),
        ("unknown_sampling_param", "POST /generate sampling_params no_stop_trimming"),
    }

    command = sglang_servers.launch_command

    def misspelt_launch(*args, **kwargs):
        argv, env = command(*args, **kwargs)
        renames = {"--mem-fraction-static": "--mem-fraction", "--random-seed": "--enable-deterministic-inference"}
        env = {k.replace("LOGPROB", "LOGPROBS"): v.replace("1", "on") for k, v in env.items()}
        return [renames.get(a, a) for a in argv], env

    monkeypatch.setattr(sglang_servers, "launch_command", misspelt_launch)
    found = {(f.kind, f.where) for _, argv, env in canopy_launches() for f in check_launch(api, argv, env)}
    assert found == {
        ("unknown_flag", "--mem-fraction"),
        ("flag_takes_no_value", "--enable-deterministic-inference"),
        ("unknown_env", "SGLANG_RETURN_ORIGINAL_LOGPROBS"),
        ("env_value", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"),
    }


def test_a_missing_or_stale_release_fails_naming_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("CANOPY_SGLANG_API", str(tmp_path))
    with pytest.raises(SGLangSourceMissing, match=r"run `make test` \(or `make sglang-api`\).*sglang==\d") as missing:
        load_api()
    assert "\n" not in str(missing.value)
    (tmp_path / "sglang" / "srt" / "entrypoints").mkdir(parents=True)
    (tmp_path / "sglang" / "srt" / "entrypoints" / "http_server.py").write_text("")
    (tmp_path / "sglang-0.4.0.dist-info").mkdir()
    (tmp_path / "sglang-0.4.0.dist-info" / "METADATA").write_text("Name: sglang\nVersion: 0.4.0\n")
    with pytest.raises(SGLangSourceMissing, match=r"holds sglang 0.4.0, the Makefile pins .*: run `make test`"):
        load_api()
