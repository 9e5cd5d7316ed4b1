"""GPU check of the Qwen3.5 pieces (issue 13): flash-linear-attention's Triton kernels against Canopy's pure-torch
Gated DeltaNet, and the Qwen3.5 policy's training step.

(a) kernels: fla's `chunk_gated_delta_rule` and `causal_conv1d` against `canopy.models.qwen3_5.gated_delta` on random
    inputs, forward and backward, in float32 and bfloat16; prints the largest relative differences and the time of
    each (fla / torch).
(b) policy: a random Qwen3.5 (`canopy.models.qwen3_5`): its logits on the GPU (fla's kernels, each row a document
    of TorchTitan's folded stream) against the same policy on CPU (the torch kernels, row by row), in float32; then
    forward + backward in bf16 autocast: step time, tokens/s and MFU (TorchTitan's FLOPs per token; H200 bf16
    dense peak 989 TFLOP/s). The dry run has no second device to compare with and only times the step.

    python scripts/gpu_check_qwen3_5.py                # GPU machine, with fla-core installed
    python scripts/gpu_check_qwen3_5.py --cpu-dry-run  # the same code path, tiny, on CPU; (a) against transformers'
                                                       # torch kernels instead of fla's (which need a GPU)

The line before the last is `RESULT {json}`, the last `gpu_check_qwen3_5: PASS` or `gpu_check_qwen3_5: FAIL (why)`.
Nothing is downloaded.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canopy.models.qwen3_5.gated_delta import causal_conv1d, chunk_gated_delta_rule  # noqa: E402

H200_BF16_PEAK = 989e12
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 5e-2}  # largest |diff| / largest |reference|


def reference_kernels(cpu: bool):
    """fla's kernels on a GPU; transformers' torch kernels on the CPU dry run. Same call shape as ours."""
    if cpu:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        def rule(q, k, v, g, beta):
            return hf.torch_chunk_gated_delta_rule.__wrapped__(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

        def conv(x, weight):
            out = hf.causal_conv1d_fn.__wrapped__(x.transpose(1, 2), weight.squeeze(1), activation="silu")
            return out.transpose(1, 2)

        return rule, conv
    from fla.modules.conv.causal_conv1d import causal_conv1d as fla_conv
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    def rule(q, k, v, g, beta):
        return fla_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    def conv(x, weight):
        return fla_conv(x=x, weight=weight.squeeze(1), bias=None, activation="silu", backend="triton")[0]

    return rule, conv


def timed(fn, device) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - started


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check_kernels(device, dtype, shape, cpu: bool, record: dict) -> list[str]:
    """Forward and backward of ours against the reference on the same inputs; returns what failed, and records
    each largest relative difference and time in `record`."""
    rule, conv = reference_kernels(cpu)
    B, T, Hk, Hv, d = shape
    g = torch.Generator(device=device).manual_seed(0)

    def make(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device=device) * scale).to(dtype).requires_grad_()

    q, k, v = make(B, T, Hk, d), make(B, T, Hk, d), make(B, T, Hv, d)
    decay = (-torch.rand(B, T, Hv, generator=g, device=device)).requires_grad_()
    beta = torch.rand(B, T, Hv, generator=g, device=device).to(dtype).requires_grad_()
    x, weight = make(B, T, 4 * d), make(4 * d, 1, 4, scale=0.5)
    failed, grads, inputs = [], {}, (q, k, v, decay, beta)
    for name, fn in (("ours", lambda: chunk_gated_delta_rule(*inputs)[0]), ("reference", lambda: rule(*inputs))):
        out, seconds = timed(fn, device)
        _, backward = timed(lambda: out.float().square().sum().backward(), device)
        grads[name] = [out.detach()] + [t.grad.clone() for t in inputs]
        for t in inputs:
            t.grad = None
        print(
            f"  gated delta rule, {name:<9} {dtype}: forward {seconds * 1e3:8.1f} ms, backward {backward * 1e3:8.1f} ms"
        )
        record[f"{name} {dtype} forward+backward ms"] = (seconds + backward) * 1e3
    for label, ours, theirs in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), grads["ours"], grads["reference"]):
        error = relative(ours, theirs)
        print(f"  {label:>6}: max relative difference {error:.2e}")
        record[f"{label} {dtype}"] = error
        if error > TOLERANCE[dtype]:
            failed.append(f"{label} {dtype} {error:.1e}")
    error = relative(causal_conv1d(x, weight), conv(x, weight))
    print(f"  causal conv: max relative difference {error:.2e}")
    record[f"conv {dtype}"] = error
    if error > TOLERANCE[dtype]:
        failed.append(f"conv {dtype} {error:.1e}")
    return failed


def check_policy_step(device, cpu: bool, record: dict) -> list[str]:
    from canopy.modules.policy import load_policy
    from canopy.tiny_model import build_tiny_checkpoint

    size = (
        dict(hidden_size=64, layers=4, heads=4, kv_heads=2, intermediate_size=128)
        if cpu
        else dict(hidden_size=1024, layers=8, heads=16, kv_heads=4, intermediate_size=3072)
    )
    rows, length = (2, 64) if cpu else (4, 4096)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / "q35", family="qwen3_5", **size)
        policy, _ = load_policy(path)
    vocab = policy.tok_embeddings.num_embeddings
    ids = torch.randint(0, vocab, (rows, length))
    failed = []
    if not cpu:
        with torch.no_grad():
            on_cpu = policy(ids[:, :512])
            on_gpu = policy.to(device)(ids[:, :512].to(device)).cpu()
        error = relative(on_gpu, on_cpu)
        print(f"  policy logits, fla on GPU vs torch kernels on CPU: max relative difference {error:.2e}")
        record["policy logits GPU vs CPU"] = error
        if error > TOLERANCE[torch.float32]:
            failed.append(f"policy logits GPU vs CPU {error:.1e}")
    policy.to(device)
    ids = ids.to(device)
    times = []
    for _ in range(3):

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not cpu):
                logits = policy(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            return loss

        loss, seconds = timed(step, device)
        times.append(seconds)
    step_time = min(times[1:])
    tokens = rows * (length - 1)
    _, flops_per_token = policy.config.get_nparams_and_flops(policy, length)
    mfu = "n/a" if cpu else f"{100 * flops_per_token * tokens / step_time / H200_BF16_PEAK:.1f}%"
    print(f"  policy step: step time {step_time:.3f} s, {tokens / step_time:,.0f} tokens/s, MFU {mfu}")
    record.update({"policy step s": step_time, "policy tokens/s": tokens / step_time, "policy MFU": mfu})
    return failed + ([] if torch.isfinite(loss) else ["policy loss not finite"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    cpu = args.cpu_dry_run
    if not cpu and not torch.cuda.is_available():
        sys.exit("gpu_check_qwen3_5: FAIL (no GPU: use --cpu-dry-run)")
    device = torch.device("cpu" if cpu else "cuda")
    shape = (1, 100, 2, 4, 16) if cpu else (2, 4096, 16, 32, 128)
    failed, record = [], {}
    print("(a) Gated DeltaNet kernels: ours against " + ("transformers' torch kernels" if cpu else "fla's"))
    for dtype in (torch.float32, torch.bfloat16):
        failed += check_kernels(device, dtype, shape, cpu, record)
    print("(b) Qwen3.5 policy: " + ("training step (torch kernels)" if cpu else "GPU against CPU, training step"))
    failed += check_policy_step(device, cpu, record)
    print("RESULT " + json.dumps(dict(record, failed=failed)))
    print("gpu_check_qwen3_5: PASS" if not failed else f"gpu_check_qwen3_5: FAIL ({'; '.join(failed)})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
