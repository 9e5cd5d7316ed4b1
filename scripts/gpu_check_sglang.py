"""GPU check of the SGLang engine (issue 4) with a small random Qwen3 built here (nothing is downloaded).

Launches one SGLang server from the SGLang venv, generates, checks the returned logprobs against HF at the sampling
temperature, syncs perturbed weights by disk and then by distributed broadcast, and confirms each time that the
server reports the new version, every sample carries it, and outputs and logprobs follow the new weights.
Run it with the SGLang venv's python (same torch on both ends of the broadcast), the repository on the path:

    PYTHONPATH=. "$CANOPY_SGLANG_PYTHON" scripts/gpu_check_sglang.py [--timeout 480]

Prints one PASS / FAIL / SKIP line per check with timings; exits 1 on any FAIL.
"""

import argparse
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3ForCausalLM

from canopy.rollout.engine import SamplingParams
from canopy.rollout.sglang import SGLangEngine, SGLangSettings
from canopy.tools.tiny_model import build_tiny_checkpoint

FAILED = []


def report(ok: bool | None, name: str, detail: str) -> None:
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if ok is False:
        FAILED.append(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_logprobs(model_dir: Path, prompts, generations, temperature: float) -> list[list[float]]:
    """HF's log softmax(logits / T) of each generated token, in float32."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for prompt, g in zip(prompts, generations):
            ids = torch.tensor([prompt + g.token_ids], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).tolist())
    return out


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return sum(abs(x - y) for x, y in pairs) / max(1, len(pairs))


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Noise on every weight and a sharpened LM head, so the next-token distributions move far from near-uniform."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    new["lm_head.weight"] = new["lm_head.weight"] * 4  # peaked, yet temperature still matters
    return new


def check_samples(
    name: str, engine, prompts, sampling, version: int, reference_dir: Path, other_dir: Path | None, before=None
):
    """Generate; every sample must carry `version` and match HF at T on `reference_dir` (and not on `other_dir`)."""
    started = time.perf_counter()
    generations = engine.generate(prompts, [24] * len(prompts), sampling)
    elapsed = time.perf_counter() - started
    faults = [g for g in generations if not hasattr(g, "token_ids")]
    if faults:
        return report(False, name, f"{len(faults)} requests failed: {faults[0]}")
    versions = {g.weight_version for g in generations}
    lp = [g.logprobs for g in generations]
    same = gap(lp, hf_logprobs(reference_dir, prompts, generations, sampling.temperature))
    at_t1 = gap(lp, hf_logprobs(reference_dir, prompts, generations, 1.0))
    detail = (
        f"{len(generations)} samples in {elapsed:.2f} s, versions {sorted(versions)}, "
        f"|lp - HF(T={sampling.temperature})| {same:.4f}, |lp - HF(T=1)| {at_t1:.4f}"
    )
    ok = versions == {version} and same < 0.1 and all(math.isfinite(x) and x <= 0 for xs in lp for x in xs)
    if other_dir is not None:
        old = gap(lp, hf_logprobs(other_dir, prompts, generations, sampling.temperature))
        changed = sum(g.token_ids != b.token_ids for g, b in zip(generations, before))
        detail += f", |lp - HF(previous weights)| {old:.4f}, outputs changed {changed}/{len(generations)}"
        ok = ok and old > 5 * max(same, 0.01) and at_t1 > 3 * max(same, 0.01) and changed > 0
    report(ok, name, detail)
    return generations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=int, default=480, help="wall-clock limit of the whole check, seconds")
    parser.add_argument("--extra-args", default="--dtype bfloat16 --cuda-graph-max-bs-decode 16")
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, lambda *_: (report(False, "timeout", f"over {args.timeout} s"), os._exit(1)))
    signal.alarm(args.timeout)

    python = os.environ.get("CANOPY_SGLANG_PYTHON")
    if not python or not torch.cuda.is_available():
        report(False, "setup", "needs CANOPY_SGLANG_PYTHON (the SGLang venv's python) and a CUDA GPU")
        sys.exit(1)
    work = Path(tempfile.mkdtemp(prefix="canopy-sglang-check-"))
    base_dir = build_tiny_checkpoint(  # head_dim 64, which every SGLang attention backend supports
        work / "base",
        hidden_size=256,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate_size=768,
        max_position_embeddings=4096,
        pad_vocab_multiple=64,
        seed=0,
    )
    base = load_file(base_dir / "model.safetensors")
    stops = [2, 0]  # <|im_end|>, <|endoftext|>
    vocab = base["lm_head.weight"].shape[0]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, vocab, (16,), generator=g).tolist() for _ in range(8)]
    sampling = SamplingParams(temperature=0.7)

    settings = SGLangSettings(
        python=python,
        base_port=free_port(),
        mem_fraction=0.2,
        sync_dir=str(work / "sync"),
        extra_args=args.extra_args.split(),
        startup_timeout_s=300,
        request_timeout_s=120,
        max_retries=1,
    )
    started = time.perf_counter()
    try:
        engine = SGLangEngine(base_dir, stops, settings, context_length=4096)
    except RuntimeError as error:
        report(False, "launch", str(error))
        sys.exit(1)
    report(True, "launch", f"server healthy at version 0 in {time.perf_counter() - started:.1f} s")
    try:
        v0 = check_samples("generate v0", engine, prompts, sampling, 0, base_dir, None)

        new = perturbed(base, seed=1)
        started = time.perf_counter()
        engine.update_weights(iter(new.items()), version=1)
        report(True, "disk sync v1", f"{time.perf_counter() - started:.2f} s, server reports version 1")
        check_samples("generate v1 (disk)", engine, prompts, sampling, 1, work / "sync" / "v1", base_dir, before=v0)

        backend = "nccl" if torch.cuda.device_count() > 1 else "gloo"  # NCCL cannot put two ranks on one GPU
        attached = SGLangSettings(
            urls=[f"http://127.0.0.1:{settings.base_port}"],
            weight_sync="distributed",
            sync_backend=backend,
            sync_master_port=free_port(),
            sync_dir=str(work / "sync_attached"),
            request_timeout_s=120,
        )
        trainer = SGLangEngine(base_dir, stops, attached)  # attaching resets the server to the base weights, version 0
        check_samples("attach resets to base v0", trainer, prompts, sampling, 0, base_dir, None)
        newer = perturbed(base, seed=2)
        reference = Path(shutil.copytree(base_dir, work / "distributed_v1"))  # HF dir of the broadcast weights
        save_file(newer, reference / "model.safetensors")
        started = time.perf_counter()
        trainer.update_weights(iter(newer.items()), version=1)
        elapsed = time.perf_counter() - started
        report(True, f"distributed sync v1 ({backend})", f"{elapsed:.2f} s, server reports version 1")
        check_samples(f"generate v1 ({backend})", trainer, prompts, sampling, 1, reference, base_dir, before=v0)
    except Exception as error:  # a check that raises is a FAIL line, not a traceback-only exit
        report(False, "engine", f"{type(error).__name__}: {error}")
    finally:
        engine.close()
    print(f"{'FAIL' if FAILED else 'PASS'} sglang engine check: {len(FAILED)} failed {FAILED}", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
