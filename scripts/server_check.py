"""What the GPU checks of the HTTP engines share (scripts/gpu_check_sglang.py, scripts/gpu_check_vllm.py): PASS /
FAIL / SKIP lines, a free port, HF's float32 logprobs of what a server sampled, and a check of one round of samples
against the weights they must come from."""

import math
import socket
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from canopy.tiny_model import build_tiny_checkpoint

FAILED = []
GAPS = {}  # check name -> mean |server logprob - HF float32 logprob| at the sampling temperature


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
    GAPS[name] = same
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


def check_model(work: Path) -> tuple[Path, dict[str, torch.Tensor], list[list[int]]]:
    """A small random Qwen3 under `work` (head_dim 64, which every SGLang and vLLM attention backend supports), its
    weights, and 8 random prompts of 16 tokens."""
    base_dir = build_tiny_checkpoint(
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
    vocab = base["lm_head.weight"].shape[0]
    g = torch.Generator().manual_seed(1)
    return base_dir, base, [torch.randint(5, vocab, (16,), generator=g).tolist() for _ in range(8)]
