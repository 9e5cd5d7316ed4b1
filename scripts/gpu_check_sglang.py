"""GPU check of the SGLang engine (issue 4) with a small random Qwen3 built here (nothing is downloaded).

Launches one SGLang server from the SGLang venv, generates, checks the returned logprobs against HF at the sampling
temperature, syncs perturbed weights by disk and then by distributed broadcast, and confirms each time that the
server reports the new version, every sample carries it, and outputs and logprobs follow the new weights.
Run it with the SGLang venv's python (same torch on both ends of the broadcast), the repository on the path:

    PYTHONPATH=. "$CANOPY_SGLANG_PYTHON" scripts/gpu_check_sglang.py [--timeout 480]

Prints one PASS / FAIL / SKIP line per check with timings; exits 1 on any FAIL.
"""

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from server_check import FAILED, check_model, check_samples, free_port, perturbed, report

from canopy.rollout.engine import SamplingParams
from canopy.rollout.sglang import SGLangEngine, SGLangSettings


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
    base_dir, base, prompts = check_model(work)
    stops = [2, 0]  # <|im_end|>, <|endoftext|>
    sampling = SamplingParams(temperature=0.7, top_p=1.0, top_k=-1)

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
