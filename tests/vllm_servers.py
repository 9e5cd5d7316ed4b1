"""Real vLLM servers for the tests (`make vllm` builds the venv they run from): where its python is, a tiny Qwen3 that
vLLM's CPU attention serves (head_dim 32: it refuses 16), free ports, the servers' Prometheus counters, and the
reference logprobs a float32 transformers forward gives for a sample."""

import os
import socket
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from canopy.tiny_model import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
STOPS = [2, 0]  # <|im_end|>, <|endoftext|> in the tiny tokenizer


def vllm_python() -> str:
    """The vLLM venv's python; a test fails in one line naming the make target when it is missing."""
    python = Path(os.environ.get("CANOPY_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    if not python.exists():
        pytest.fail(f"no vLLM venv at {python}: run `make test` (or `make vllm`)", pytrace=False)
    return str(python)


def build_servable_tiny(folder: Path) -> Path:
    """The tiny Qwen3 of the embedded default with 2 query heads and 1 KV head of 32 dimensions."""
    return build_tiny_checkpoint(folder / "tiny-qwen3-h2", heads=2, kv_heads=1, seed=0)


def free_base_port(count: int, start: int = 32000) -> int:
    """The first of `count` consecutive ports nobody listens on."""
    for base in range(start, start + 2000, count):
        sockets = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports")


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus counter's samples on one server's /metrics (e.g. vllm:prefix_cache_hits_total)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def reference_logprobs(model_path: Path, weights: dict | None, prompt: list[int], sample: list[int], temperature):
    """log softmax(logits / T) of each sampled token, from a float32 transformers forward of prompt + sample."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    ids = torch.tensor([prompt + sample])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample)[:, None])[:, 0]
