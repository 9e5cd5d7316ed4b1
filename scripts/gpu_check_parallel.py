"""GPU check of the sharded training step: step time, tokens/s and MFU of `CanopyModule`'s real update on a small
random Qwen3, and, with two or more GPUs, context parallel (x TP x FSDP) against one GPU.

(a) one rank: policy + frozen reference, canopy_loss (Eq. 8), one optimizer step per batch and the weight-sync walk,
    in bf16 (autocast), on synthetic rollout batches; prints step time, tokens/s and MFU (TorchTitan's FLOPs per
    token, 6N + attention, plus a third of that for the reference's forward; H200 bf16 dense peak 989 TFLOP/s).
(b) if torch.cuda.device_count() >= 2: the same steps over dp_shard x tp x cp (cp = 2, tp = 2 from 4 GPUs, up to 8),
    compared with (a): ring attention over head-tail sharded sequences, which only GPUs run. The CPU dry run
    checks dp_shard x tp instead (SDPA has no CPU sharding rule for CP). Each data-parallel shard gets its own rows,
    and the weights gathered into rank 0 alone (NCCL gather) must equal the all-gathered ones exactly.
(c) then HSDP, as across nodes: dp_replicate = 2 replicas of a (GPUs / 2)-way FSDP model, compared with (a).
`--family qwen3_5` runs both parts on a random Qwen3.5 (Gated DeltaNet + full attention): (b) as tp = 2 x dp_shard
(TorchTitan has no CP for Qwen3.5), and on the CPU dry run as dp_shard = 2 (its torch kernels run unsharded).

    python scripts/gpu_check_parallel.py                # GPU machine; scripts/device_check.sh runs it
    python scripts/gpu_check_parallel.py --cpu-dry-run  # the same code path, tiny, on CPU (gloo)
    python scripts/gpu_check_parallel.py --family qwen3_5 [--cpu-dry-run]

Each part runs under torchrun with a timeout; the last line is `gpu_check_parallel: PASS` or `... FAIL (why)`.
Nothing is downloaded: the model is a random Qwen3 written locally in HF format.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from canopy.models import MODEL_FAMILIES, get_family  # noqa: E402

H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s
# fmt: off
GPU_MODEL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                 intermediate_size=3072, vocab_size=32768, seq_len=8192, rows=4, micro_batch_tokens=16384)
CPU_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, seq_len=64, rows=4, micro_batch_tokens=128)
# fmt: on
COMPARED = ("actor/entropy", "actor/grad_norm", "actor/kl", "actor/loss")


def write_random_model(spec, path: Path, shape: dict) -> Path:
    """A random model of the family in HF format (config.json + model.safetensors), built by the family's spec as
    the tiny checkpoint is; no tokenizer is needed for the update."""
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
    )
    shared = {k: shape[k] for k in keys} | {"max_position_embeddings": shape["seq_len"], "tie_word_embeddings": False}
    torch.manual_seed(0)
    spec.tiny_model(shared).save_pretrained(path)
    return path


def synthetic_batch(shape: dict, step: int, version: int):
    """A packed rollout batch: prompt tokens first (mask 0), then alternating action / observation spans; rows
    shorter by 7 tokens each, so that micro-batches differ in width and CP pads them."""
    from canopy.step import RolloutBatch

    g = torch.Generator().manual_seed(step)
    rows, width = shape["rows"], shape["seq_len"]
    input_ids = torch.randint(0, shape["vocab_size"], (rows, width), generator=g)
    position = torch.arange(width)
    action_mask = (position >= width // 8) & ((position // (width // 16)) % 2 == 1)
    lengths = width - 7 * torch.arange(rows)
    action_mask = action_mask & (position < lengths[:, None])
    input_ids[position >= lengths[:, None]] = 0
    advantages = torch.randn(rows, generator=g)
    return RolloutBatch(
        input_ids,
        action_mask,
        torch.zeros(rows, width),
        torch.where(action_mask, version, -1),
        (advantages - advantages.mean()) / advantages.std(),
        lengths,
        {},
    )


def run_worker(args) -> None:
    """One rank of a part: train `--steps` steps with Lightning and write rank 0's metrics and step times."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from canopy.build import build_module
    from canopy.config import compose_config
    from canopy.datamodules.rollout import split_rows
    from canopy.modules.parallel import data_parallel_rank
    from canopy.modules.policy import export_hf_state_dict
    from canopy.rollout.engine import EngineHandle

    shape = CPU_MODEL if args.cpu_dry_run else GPU_MODEL
    world = args.dp_replicate * args.dp * args.tp * args.cp

    class WalkWeights:
        """Stands in for the engine: takes the weights (walks the stream), keeps nothing."""

        dtype = "bfloat16"  # what `EngineHandle` reads (no on-policy audit here)

        def update_weights(self, named_tensors, version):
            for _ in named_tensors:
                pass

    engine = EngineHandle(WalkWeights())

    class SyntheticRollouts(L.LightningDataModule):
        """Stands in for RolloutDataModule: a fresh batch at the weight version the engine holds, each data-parallel
        shard given its own rows (as `RolloutStream` deals them)."""

        def train_dataloader(self):
            return (self.rows(synthetic_batch(shape, step, engine.version)) for step in range(args.steps))

        def rows(self, batch):
            dp_rank, dp_size = data_parallel_rank(module.parallel_dims)
            return split_rows(batch, dp_size)[dp_rank]

    class Record(L.Callback):
        def __init__(self):
            self.metrics, self.times = [], [time.perf_counter()]

        def on_train_batch_end(self, trainer, *unused):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in COMPARED})

    cfg = compose_config(
        [
            "algorithm.kl_coef=0.1",
            "optim.lr=1e-4",
            f"trainer.micro_batch_tokens={shape['micro_batch_tokens']}",
            f"parallelism.dp_replicate={args.dp_replicate}",
            f"parallelism.dp_shard={args.dp}",
            f"parallelism.tp={args.tp}",
            f"parallelism.cp={args.cp}",
        ]
    )
    module = build_module(cfg, args.model, engine)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu" if args.cpu_dry_run else "gpu",
        devices=world,
        strategy=ModelParallelStrategy(
            data_parallel_size=args.dp_replicate * args.dp * args.cp, tensor_parallel_size=args.tp
        )
        if world > 1
        else "auto",
        precision="32-true" if args.cpu_dry_run else "bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(module, datamodule=SyntheticRollouts())
    _, flops_per_token = module.policy.config.get_nparams_and_flops(module.policy, shape["seq_len"])
    # weight sync / export gather into rank 0 only (dist.gather over NCCL); all-gathered on every rank for reference
    on_rank0, everywhere = dict(module.iter_hf_weights()), export_hf_state_dict(module.policy, module.adapter)
    if trainer.is_global_zero:
        gather_diff = max((on_rank0[k].float() - v.float()).abs().max().item() for k, v in everywhere.items())
        Path(args.out).write_text(
            json.dumps(
                {
                    "metrics": record.metrics,
                    "step_times": [b - a for a, b in zip(record.times, record.times[1:])],
                    "tokens_per_step": shape["rows"] * shape["seq_len"],
                    "flops_per_token": flops_per_token,
                    "world": world,
                    "gather_diff": gather_diff,
                }
            )
        )


def run_part(args, dp: int, tp: int, cp: int, out: Path, timeout: int, replicate: int = 1) -> dict | None:
    """Launch one part under torchrun; its rank 0's results, or None (with the reason printed) if it failed."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={replicate * dp * tp * cp}",
        __file__,
        "--worker",
        "--model",
        str(args.model),
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--dp",
        str(dp),
        "--tp",
        str(tp),
        "--cp",
        str(cp),
        "--dp-replicate",
        str(replicate),
    ] + (["--cpu-dry-run"] if args.cpu_dry_run else [])
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired:
        print(f"  dp_replicate={replicate} dp_shard={dp} tp={tp} cp={cp}: timed out after {timeout} s")
        return None
    if run.returncode != 0:
        print(f"  dp_replicate={replicate} dp_shard={dp} tp={tp} cp={cp}: exit {run.returncode}\n{run.stderr[-4000:]}")
        return None
    return json.loads(out.read_text())


def report_speed(result: dict, peak: float | None) -> None:
    measured = result["step_times"][1:] or result["step_times"]  # the first step warms up
    step_time = sum(measured) / len(measured)
    tokens = result["tokens_per_step"]
    flops = tokens * result["flops_per_token"] * (1 + 1 / 3)  # policy forward + backward, reference forward
    mfu = f"{100 * flops / step_time / (peak * result['world']):.1f}%" if peak else "n/a (CPU)"
    print(
        f"  step time {step_time:.3f} s, {tokens / step_time:,.0f} tokens/s, MFU {mfu}, "
        f"{flops / 1e12:.2f} TFLOP per step"
    )


def compare(single: dict, sharded: dict, tolerance: float) -> list[str]:
    """Metrics of the sharded run that differ from one rank's by more than `tolerance` (relative)."""
    bad = []
    for step, (a, b) in enumerate(zip(single["metrics"], sharded["metrics"], strict=True)):
        for key in COMPARED:
            if not abs(a[key] - b[key]) <= tolerance * max(1e-3, abs(a[key])):
                bad.append(f"step {step} {key}: {a[key]:.6g} vs {b[key]:.6g}")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU (gloo): exercises the code path")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--family", choices=tuple(MODEL_FAMILIES), default="qwen3", help="the policy's model family")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per part")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    for degree in ("dp", "tp", "cp", "dp-replicate"):
        parser.add_argument(f"--{degree}", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from canopy.modules.parallel import end_rank

        run_worker(args)
        end_rank()  # no finalization: a gloo worker thread could abort the finished rank there

    shape, failures = (CPU_MODEL if args.cpu_dry_run else GPU_MODEL), []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        scratch = Path(scratch)
        spec = get_family(args.family)
        args.model = write_random_model(spec, scratch / args.family, shape)
        print(f"(a) one rank, {shape['rows']} x {shape['seq_len']} tokens per step, {args.steps} steps")
        single = run_part(args, 1, 1, 1, scratch / "single.json", args.timeout)
        if single is None:
            failures.append("single rank did not finish")
        else:
            report_speed(single, None if args.cpu_dry_run else H200_BF16_PEAK)
            if not all(math.isfinite(v) for m in single["metrics"] for v in m.values()):
                failures.append("non-finite metrics on one rank")

        gpus = 2 if args.cpu_dry_run else min(8, torch.cuda.device_count())
        if gpus < 2:
            print("(b) skipped: one GPU (CP, TP and FSDP need two or more)")
        elif single is not None:
            if args.cpu_dry_run:  # SDPA has no CPU sharding rule for CP; some families' kernels no TP on CPU
                tp, cp = (1, 1) if spec.cpu_tp_cp_refusal else (2, 1)
            else:  # without CP in the family, TP splits the sequences
                tp, cp = (2 if gpus >= 4 else 1, 2) if spec.context_parallel else (2, 1)
            dp = gpus // (tp * cp)
            print(f"(b) dp_shard={dp} x tp={tp} x cp={cp} against one rank")
            sharded = run_part(args, dp, tp, cp, scratch / "sharded.json", args.timeout)
            if sharded is None:
                failures.append("sharded run did not finish")
            else:
                report_speed(sharded, None if args.cpu_dry_run else H200_BF16_PEAK)
                bad = compare(single, sharded, 1e-5 if args.cpu_dry_run else 2e-2)
                print("  matches one rank" if not bad else "  differs: " + "; ".join(bad[:4]))
                failures += ["sharded metrics differ from one rank"] if bad else []
                print(f"  weights gathered into rank 0 vs all-gathered: max diff {sharded['gather_diff']}")
                failures += ["weights gathered into rank 0 differ"] if sharded["gather_diff"] != 0 else []
            replicas, shards = 2, gpus // 2  # as across nodes: each replica a dp_shard-way FSDP model
            print(f"(c) HSDP: dp_replicate={replicas} x dp_shard={shards} against one rank")
            hsdp = run_part(args, shards, 1, 1, scratch / "hsdp.json", args.timeout, replicate=replicas)
            if hsdp is None:
                failures.append("HSDP run did not finish")
            else:
                bad = compare(single, hsdp, 1e-5 if args.cpu_dry_run else 2e-2)
                print("  matches one rank" if not bad else "  differs: " + "; ".join(bad[:4]))
                failures += ["HSDP metrics differ from one rank"] if bad else []
                failures += ["HSDP weights gathered into rank 0 differ"] if hsdp["gather_diff"] != 0 else []
    print("gpu_check_parallel: PASS" if not failures else f"gpu_check_parallel: FAIL ({'; '.join(failures)})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
