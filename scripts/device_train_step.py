"""Device check (b): Canopy's training step on one GPU, on random models of realistic shape, against the memory
plan. A Qwen3 of 1.7B's shape and a Qwen3.5 of about 4B (Qwen3.5's 4B layer shapes and vocabulary, 24 layers),
policy + frozen reference + logprob head + AdamW through `CanopyModule`'s own step
(`canopy.tools.memory_measure.measure_training_step`), full activation checkpointing:
- float32, as one process trains: the step's peak allocated memory and each term, against the plan for the same
  configuration (`canopy.memory.trainer_plan`, its allocator-free terms);
- bf16 autocast over float32 weights: step time, tokens/s, and MFU against the H200's 989 TFLOP/s dense bf16
  (TorchTitan's FLOPs per token: 6N + attention, plus a third for the reference's forward).
The model is built on the GPU (no checkpoint is written). The last line is `RESULT {json}`.

    python scripts/device_train_step.py                # on the GPU machine (scripts/device_check.sh runs it)
    python scripts/device_train_step.py --cpu-dry-run  # the same code path, tiny, on CPU
"""

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canopy.memory import TrainerLayout, model_shape, trainer_plan  # noqa: E402
from canopy.tools.memory_measure import measure_training_step, qwen3_5_config, qwen3_config  # noqa: E402

GIB = 2**30
H200_BF16_PEAK = 989e12
TERMS = ("weights", "gradients", "optimizer", "reference", "activations", "logprob head", "peak")


# the released models' context and RoPE (no effect on memory or speed; kept as the real configs have them)
QWEN3 = dict(max_position_embeddings=40960, rope_theta=1000000.0)
QWEN3_5 = dict(
    max_position_embeddings=131072,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
# name: (config.json, rows, sequence length, head chunk)
GPU_MODELS = {
    "qwen3-1.7b": (qwen3_config(2048, 6144, 16, 8, 128, 28, 151936, **QWEN3), 2, 8192, 2048),
    "qwen3_5-4b": (qwen3_5_config(2560, 9216, 24, 248320, 16, 4, 256, (16, 32, 128), **QWEN3_5), 1, 8192, 2048),
}
CPU_MODELS = {
    "qwen3-tiny": (qwen3_config(64, 192, 4, 2, 16, 2, 512, **QWEN3), 2, 128, 64),
    "qwen3_5-tiny": (qwen3_5_config(64, 192, 4, 512, **QWEN3_5), 1, 128, 64),
}


def flops_per_token(hf: dict, seq_len: int) -> tuple[int, float]:
    """(parameters, training FLOPs per token) from TorchTitan's own count, on a meta-device model."""
    from canopy.modules.policy import build_model

    model = build_model(hf, "meta")
    return model.config.get_nparams_and_flops(model, seq_len)


def check(name: str, hf: dict, rows: int, seq_len: int, chunk: int, device: str) -> dict:
    layout = TrainerLayout(
        activation_checkpointing="full",
        micro_batch_tokens=rows * seq_len,
        max_context_tokens=seq_len,
        logprob_chunk_tokens=chunk,
        device="cuda" if device == "cuda" else "cpu",
    )
    plan = trainer_plan(model_shape(json.dumps(hf, sort_keys=True)), layout)
    planned = {term.name: term.bytes for term in plan.terms}
    planned["logprob head"] = plan.working["logprob head"]
    planned["peak"] = sum(term.bytes for term in plan.terms if not term.gpu_only)

    measured = measure_training_step(hf, layout, rows, seq_len, device=device)
    _free()
    fast = measure_training_step(hf, layout, rows, seq_len, device=device, autocast=torch.bfloat16, repeats=3)
    _free()
    params, per_token = flops_per_token(hf, seq_len)
    tokens = rows * seq_len
    seconds = fast["step seconds"]
    flops = tokens * per_token * (1 + 1 / 3)
    result = dict(
        params_b=params / 1e9,
        tokens=tokens,
        float32_step_s=measured["step seconds"],
        bf16_step_s=seconds,
        tokens_per_s=tokens / seconds,
        mfu=flops / seconds / H200_BF16_PEAK if device == "cuda" else None,
        planned_gib={t: planned[t] / GIB for t in TERMS},
        measured_gib={t: measured[t] / GIB for t in TERMS},
        plan_over_measured={t: planned[t] / measured[t] for t in TERMS if measured[t]},
        bf16_peak_gib=fast["peak"] / GIB,
    )
    mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "n/a (CPU)"
    print(f"{name}: {params / 1e9:.2f} B parameters, {rows} x {seq_len:,} tokens, full checkpointing")
    for term in TERMS:
        print(
            f"  {term:>13}: plan {planned[term] / GIB:8.3f} GiB, measured {measured[term] / GIB:8.3f} GiB "
            f"(plan / measured {result['plan_over_measured'].get(term, float('nan')):.3f})"
        )
    print(f"  bf16 autocast: step time {seconds:.3f} s, {tokens / seconds:,.0f} tokens/s, MFU {mfu}")
    return result


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--models", nargs="+", help="a subset of the models, by name")
    args = parser.parse_args()
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("device_train_step: no GPU: run it on the GPU machine, or with --cpu-dry-run")
    models = CPU_MODELS if args.cpu_dry_run else GPU_MODELS
    results = {}
    for name in args.models or models:
        hf, rows, seq_len, chunk = models[name]
        results[name] = check(name, hf, rows, seq_len, chunk, device)
        if device == "cuda":
            results[name]["max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            torch.cuda.reset_peak_memory_stats()
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
