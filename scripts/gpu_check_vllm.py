"""GPU check of the vLLM engine (issue 45) with a small random Qwen3 built here (nothing is downloaded).

Launches one vLLM server (CUDA build, bfloat16) from the vLLM venv, generates, measures the bf16 gap of the returned
logprobs against a float32 HF forward at the sampling temperature, then pushes perturbed weights by vLLM's native
NCCL weight transfer (the trainer on GPU 0, the server on GPU 1: NCCL puts no two ranks on one GPU) or, on one GPU,
by disk, and confirms that the server reports the new version, every sample carries it, and outputs and logprobs
follow the new weights. Run it with the vLLM venv's python (its torch on both ends), the repository on the path:

    PYTHONPATH=. "$CANOPY_VLLM_PYTHON" scripts/gpu_check_vllm.py [--timeout 280]

Prints one PASS / FAIL / SKIP line per check with timings, and a RESULT line with the numbers; exits 1 on any FAIL.
"""

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from server_check import FAILED, GAPS, check_model, check_samples, free_port, perturbed, report

from canopy.rollout.engine import SamplingParams
from canopy.rollout.vllm import VLLMEngine, VLLMSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=int, default=280, help="wall-clock limit of the whole check, seconds")
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, lambda *_: (report(False, "timeout", f"over {args.timeout} s"), os._exit(1)))
    signal.alarm(args.timeout)

    python = os.environ.get("CANOPY_VLLM_PYTHON")
    if not python or not torch.cuda.is_available():
        report(False, "setup", "needs CANOPY_VLLM_PYTHON (the CUDA vLLM venv's python) and a CUDA GPU")
        sys.exit(1)
    two_gpus = torch.cuda.device_count() > 1
    work = Path(tempfile.mkdtemp(prefix="canopy-vllm-check-"))
    base_dir, base, prompts = check_model(work)
    sampling = SamplingParams(temperature=0.7, top_p=1.0, top_k=-1)
    settings = VLLMSettings(
        python=python,
        base_port=free_port(),
        device="cuda",
        dtype="bfloat16",
        base_gpu_id=1 if two_gpus else 0,
        gpu_memory_utilization=0.3,
        weight_sync="nccl" if two_gpus else "disk",
        sync_dir=str(work / "sync"),
        startup_timeout_s=200,
        request_timeout_s=120,
        max_retries=1,
    )
    if not two_gpus:
        report(None, "nccl transfer", "one GPU: NCCL puts no two ranks on one GPU; the weights go by disk instead")
    started = time.perf_counter()
    try:
        engine = VLLMEngine(base_dir, [2, 0], settings, context_length=4096)
    except RuntimeError as error:
        report(False, "launch", str(error))
        sys.exit(1)
    launch_s = time.perf_counter() - started
    report(True, "launch", f"server healthy at version 0 in {launch_s:.1f} s ({settings.weight_sync} weight sync)")
    numbers = {"launch_s": round(launch_s, 1), "weight_sync": settings.weight_sync}
    try:
        v0 = check_samples("generate v0", engine, prompts, sampling, 0, base_dir, None)
        new = perturbed(base, seed=1)
        reference = Path(shutil.copytree(base_dir, work / "v1"))  # HF dir of the pushed weights
        save_file(new, reference / "model.safetensors")
        started = time.perf_counter()
        engine.update_weights(iter(new.items()), version=1)
        numbers["sync_s"] = round(time.perf_counter() - started, 3)
        report(True, f"{settings.weight_sync} sync v1", f"{numbers['sync_s']:.2f} s, server reports version 1")
        check_samples(f"generate v1 ({settings.weight_sync})", engine, prompts, sampling, 1, reference, base_dir, v0)
        numbers["bf16_gap"] = {name: round(value, 5) for name, value in GAPS.items()}
    except Exception as error:  # a check that raises is a FAIL line, not a traceback-only exit
        report(False, "engine", f"{type(error).__name__}: {error}")
    finally:
        engine.close()
    print("RESULT " + json.dumps(numbers), flush=True)
    print(f"{'FAIL' if FAILED else 'PASS'} vllm engine check: {len(FAILED)} failed {FAILED}", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
