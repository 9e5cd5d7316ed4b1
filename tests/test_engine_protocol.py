"""The `Engine` protocol (canopy/rollout/engine.py) is the whole contract: every engine, the test doubles included,
declares each of its members with the protocol's signature, and the code reads those members instead of probing
for them. One behaviour test per capability: `concurrent` (how the agent loop meets the engine), `counters` (the
step's `engine/*` metrics), `rng_state` / `load_rng_state` (the checkpoint's `engine_rng`), `can_relaunch` /
`relaunched` (budget transfer's end-of-training relaunch; the launched servers' side: tests/test_sglang_engine.py)."""

import inspect
import warnings
from collections.abc import Mapping
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from canopy.callbacks import BudgetTransferEval
from canopy.config import compose_config
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.protocols import mismatches, protocol_members
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.engine import Engine, EngineHandle
from canopy.rollout.http.engine import HTTPEngine
from canopy.rollout.local import LocalEngine
from canopy.rollout.sglang import SGLangEngine, SGLangSettings
from canopy.rollout.vllm import VLLMEngine, VLLMSettings
from tests.fake_sglang import FakeSGLang
from tests.fake_vllm import FakeVLLM
from tests.helpers import UNFILTERED, datamodule
from tests.scripted import FakeEngine, RecordingEngine, ScriptedEngine

STOPS = [2, 0]  # <|im_end|>, <|endoftext|> in the tiny tokenizer
BUDGET = Budget(
    max_turns=3, max_response_tokens=64, max_prompt_tokens=256, max_observation_tokens=32, max_context_tokens=512
)
DATA = {"weight_version": int, "dtype": str, "concurrent": bool, "counters": Mapping, "can_relaunch": bool}


def test_the_protocol_is_what_the_run_uses():
    members = protocol_members(Engine)
    assert {name for name, signature in members.items() if signature is None} == set(DATA)
    assert {name for name, signature in members.items() if signature is not None} == {
        "generate",
        "release",
        "update_weights",
        "at_budget",
        "relaunched",
        "evaluation_seed",
        "rng_state",
        "load_rng_state",
        "close",
    }


@pytest.fixture
def servers():
    started = []
    yield started
    for server in started:
        server.stop()


def build(kind: str, tiny_path, tokenizer, tmp_path, servers):
    if kind == "local":
        return LocalEngine(tiny_path, STOPS, tokenizer.pad_token_id)
    if kind in ("sglang", "vllm"):
        server = (FakeSGLang if kind == "sglang" else FakeVLLM)()
        servers.append(server)
        settings = dict(urls=[server.url], sync_dir=str(tmp_path / "sync"), max_retries=1, concurrency=2)
        if kind == "sglang":
            return SGLangEngine(tiny_path, STOPS, SGLangSettings(**settings), retry_backoff_s=0.0)
        return VLLMEngine(tiny_path, STOPS, VLLMSettings(**settings), retry_backoff_s=0.0, health_interval_s=0.02)
    if kind == "scripted":
        return ScriptedEngine(tokenizer, ["key"])
    return RecordingEngine(tokenizer) if kind == "recording" else FakeEngine()


@pytest.mark.parametrize("kind", ["local", "sglang", "vllm", "fake", "scripted", "recording"])
def test_every_engine_declares_every_protocol_member_with_its_signature(kind, tiny_path, tokenizer, tmp_path, servers):
    engine = build(kind, tiny_path, tokenizer, tmp_path, servers)
    try:
        assert mismatches(type(engine), Engine) == [] and isinstance(engine, Engine)
        for name, kind_of in DATA.items():
            assert isinstance(getattr(engine, name), kind_of), (kind, name)
        for name, expected in protocol_members(Engine).items():
            if expected is None:
                continue
            got = inspect.signature(getattr(type(engine), name))  # defaults too
            assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == [
                (p.name, p.kind, p.default) for p in expected.parameters.values()
            ], (kind, name)
    finally:
        engine.close()


def test_concurrent_engines_get_each_episodes_request_alone_batch_engines_every_live_one_at_once(tokenizer):
    """`concurrent`: the in-process environment's episodes are batched for a batch-at-a-time engine and sent one by
    one, from their own threads, to a concurrent one."""

    class Batches(ScriptedEngine):
        def __init__(self, concurrent: bool):
            super().__init__(tokenizer, ["key"])
            self.concurrent = concurrent

    jobs = [(task, 0) for task in EmbeddedEnvironment().tasks("train")[:3]]
    for concurrent, sizes in ((False, {3}), (True, {1})):
        engine = Batches(concurrent)
        run_episodes(engine, EmbeddedEnvironment(), tokenizer, jobs, BUDGET, UNFILTERED)
        assert {len(prompts) for prompts, _ in engine.calls} == sizes


def test_counters_are_the_steps_engine_metrics(tiny_path, tokenizer):
    """`counters`: the local engine's counts become the step's `engine/*` metrics; an engine without any logs none."""
    local = datamodule(tokenizer, LocalEngine(tiny_path, STOPS, tokenizer.pad_token_id), tasks_per_step=1)
    metrics = local.next_batch().metrics
    assert metrics["engine/prefill_tokens"] == local.engine.counters["prefill_tokens"] > 0
    scripted = datamodule(tokenizer, ScriptedEngine(tokenizer, ["key"]), tasks_per_step=1)
    assert not [k for k in scripted.next_batch().metrics if k.startswith("engine/")]


def test_the_checkpoint_round_trips_the_local_engines_sampler_and_saves_none_for_others(tiny_path, tokenizer):
    """`rng_state` / `load_rng_state`: the data module's state carries the local engine's sampler (`engine_rng`), and
    a resumed run draws what the saved one would have; an engine without a sampler of its own saves nothing."""
    engine = LocalEngine(tiny_path, STOPS, tokenizer.pad_token_id, seed=3)
    dm = datamodule(tokenizer, engine)
    prompt = tokenizer.encode("task : vault 1", add_special_tokens=False)
    engine.generate([prompt], [6], UNFILTERED)
    state = dm.state_dict()
    assert torch.equal(state["engine_rng"], engine.rng_state())
    expected = engine.generate([prompt], [6], UNFILTERED)[0].token_ids
    resumed = LocalEngine(tiny_path, STOPS, tokenizer.pad_token_id, seed=3)
    datamodule(tokenizer, resumed).load_state_dict(state)
    assert resumed.generate([prompt], [6], UNFILTERED)[0].token_ids == expected
    assert "engine_rng" not in datamodule(tokenizer, ScriptedEngine(tokenizer, ["key"])).state_dict()


def test_http_engines_keep_no_sampler_or_counters_and_close_before_their_servers_are_up(tiny_path, tmp_path, servers):
    """The servers own the sampling state and the counts; an engine whose servers never came up still closes."""
    server = FakeSGLang()
    servers.append(server)
    settings = SGLangSettings(urls=[server.url], sync_dir=str(tmp_path / "sync"), max_retries=1, concurrency=2)
    engine = SGLangEngine(tiny_path, STOPS, settings, retry_backoff_s=0.0)
    assert engine.rng_state() is None and dict(engine.counters) == {} and not engine.can_relaunch
    engine.load_rng_state(None)
    engine.close()

    def fail(*args):
        raise RuntimeError("no server came up")

    stopped = []
    fleet = SimpleNamespace(backend=None, settings=SimpleNamespace(concurrency=1), start=fail)
    fleet.stop = lambda: stopped.append("fleet")
    router = SimpleNamespace(close=lambda: stopped.append("router"))
    with pytest.raises(RuntimeError, match="no server came up"):
        HTTPEngine(fleet, router, None, "bfloat16", context_length=None, rope_scaling=None, seed=0)
    assert stopped == ["router", "fleet"]


def test_an_engine_that_cannot_relaunch_leaves_the_final_budgets_it_cannot_serve_to_evaluate_py(tokenizer, tmp_path):
    """`can_relaunch`: budget transfer relaunches only engines that say they can; another's final evaluation at a
    budget it cannot serve is left to evaluate.py, and `relaunched` is never called."""

    cfg = compose_config([])

    class Unservable(ScriptedEngine):
        def at_budget(self, context_length, rope_scaling):
            return self if context_length <= cfg.budget.max_context_tokens else None  # not the enlarged budget

        def relaunched(self, context_length, rope_scaling):
            raise AssertionError("relaunched although can_relaunch is False")

    run_config = OmegaConf.create({k: cfg[k] for k in ("seed", "budget", "sampling")})
    run_config.budget.max_turns = 1
    callback = BudgetTransferEval(run_config, cfg.eval.enlarged, split="test", every_n_steps=5)
    callback.configs["enlarged_budget"].budget.max_turns = 1
    engine = Unservable(tokenizer, ["key"])
    dm = SimpleNamespace(engine=engine, env=EmbeddedEnvironment(), tokenizer=tokenizer, trajectory_log=None)
    dm.max_quarantine_fraction = 0.5
    trainer = SimpleNamespace(global_step=5, is_global_zero=True, world_size=1, loggers=[], datamodule=dm)
    trainer.default_root_dir = str(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = callback.evaluate(trainer, SimpleNamespace(weight_version=5), final=True)
    assert [r["role"] for r in results] == ["training_budget"]
    assert any("evaluation is left by evaluate.py" in str(w.message) for w in caught)


def test_the_handle_reads_the_engines_dtype():
    assert EngineHandle(FakeEngine()).dtype == "float32"
    assert EngineHandle(FakeEngine, dtype="bfloat16").dtype == "bfloat16"  # a builder: given, never built for it
