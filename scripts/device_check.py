"""The one command for a lent GPU machine (one H200, at most 10 minutes a command, at most 8 files back): every part
a subprocess with its own timeout, its output in `<out>/<part>.log`, and one `<out>/summary.json` with each part's
status, seconds and numbers (the `RESULT {json}` line each part prints). scripts/device_check.sh installs the device
bundle first and then runs this.

  kernels       (a) fla's Gated DeltaNet kernels against Canopy's torch kernels, forward and backward, fp32 and
                    bf16; a Qwen3.5 policy on the GPU against the CPU (scripts/gpu_check_qwen3_5.py)
  train_step    (b) the training step on random Qwen3 1.7B and Qwen3.5 ~4B: peak memory against the memory plan,
                    step time, tokens/s, MFU (scripts/device_train_step.py)
  logprob_head  (c) the chunked logprob head at 32k-131k tokens x 152k and 248k vocabularies: peak against the plan
                    (bench/logprob_head.py)
  engine_gap    (d) the local engine in bf16 against the float32 trainer on sampled episodes
                    (scripts/device_embedded.py --part gap)
  embedded      (e) the embedded default for 20 steps on the GPU: step time against the CPU, and that it learns
                    (scripts/device_embedded.py --part learn)
  parallel, parallel_qwen3_5   FSDP x TP x CP (Qwen3: cp 2) and HSDP against one rank, Qwen3 and Qwen3.5
                    (scripts/gpu_check_parallel.py): 2+ GPUs and torch >= 2.13
  sglang        an SGLang server against HF, disk and distributed weight sync (scripts/gpu_check_sglang.py): the
                    SGLang venv's python in CANOPY_SGLANG_PYTHON (`make sglang`)
  vllm          a bf16 vLLM server against HF (the gap), weights by vLLM's NCCL transfer on 2+ GPUs, else by disk
                    (scripts/gpu_check_vllm.py): a CUDA vLLM venv's python in CANOPY_VLLM_PYTHON
A part that cannot run where it is (one GPU, torch 2.11, no SGLang or vLLM venv: neither wheel fits the lent
machine's 64 MiB bundle) is skipped with the reason. On a GPU node of one's own (the project's venv, 8 GPUs, SGLang,
vLLM) the same command runs every part:
    PY=.venv/bin/python CANOPY_SGLANG_PYTHON=.venv-sglang/bin/python CANOPY_VLLM_PYTHON=.venv-vllm-cuda/bin/python \
        bash scripts/device_check.sh

    bash scripts/device_check.sh                 # on the device (its python: /opt/torch/.venv/bin/python)
    bash scripts/device_check.sh --cpu-dry-run   # every part tiny on the CPU (tests/test_device_check.py)
    python scripts/device_check.py --report outputs/device_check/summary.json   # as markdown (docs/device_check.md)
"""

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
HEAD = ["--hidden", "4096", "--chunk", "2048", "--dtype", "bfloat16", "--device", "cuda", "--repeats", "2"]
HEAD_TOKENS = ["--tokens", "32768", "65536", "131072"]
DRY_HEAD = ["--tokens", "256", "512", "--vocab", "3000", "--hidden", "32", "--chunk", "64", "--device", "cpu"]
DRY_RUN_SLACK = 3  # the dry run's parts are tiny, but this machine's 2 CPUs run them slower than the GPU runs its own


@dataclass(frozen=True)
class Part:
    seconds: int  # its timeout on the GPU (the lent machine's parts sum to 8 minutes)
    commands: list[list[str]]  # on the GPU, in order
    dry_run: list[list[str]] | None = None  # on the CPU dry run (default: each command with --cpu-dry-run)
    gpus: int = 1  # 2+: TP, CP, HSDP (the dry run has none)
    multiprocess: bool = False  # several processes: torch >= 2.13 (canopy/compat.py)
    python: str | None = None  # the environment variable naming the python it runs on, else this one


PARTS = {
    "kernels": Part(110, [["scripts/gpu_check_qwen3_5.py"]]),
    "train_step": Part(150, [["scripts/device_train_step.py"]]),
    "logprob_head": Part(
        50,
        [
            ["bench/logprob_head.py", *HEAD_TOKENS, "--vocab", "151936", *HEAD],
            ["bench/logprob_head.py", *HEAD_TOKENS, "--vocab", "248320", *HEAD],
        ],
        [["bench/logprob_head.py", *DRY_HEAD, "--repeats", "1"]],
    ),
    "engine_gap": Part(50, [["scripts/device_embedded.py", "--part", "gap"]]),
    "embedded": Part(120, [["scripts/device_embedded.py", "--part", "learn"]]),
    "parallel": Part(300, [["scripts/gpu_check_parallel.py", "--timeout", "140"]], gpus=2, multiprocess=True),
    "parallel_qwen3_5": Part(
        240, [["scripts/gpu_check_parallel.py", "--family", "qwen3_5", "--timeout", "110"]], gpus=2, multiprocess=True
    ),
    "sglang": Part(300, [["scripts/gpu_check_sglang.py", "--timeout", "280"]], python="CANOPY_SGLANG_PYTHON"),
    "vllm": Part(300, [["scripts/gpu_check_vllm.py", "--timeout", "280"]], python="CANOPY_VLLM_PYTHON"),
}
SERVER_VENVS = {  # a part's python -> what it is, for the skip reason
    "CANOPY_SGLANG_PYTHON": ("SGLang", "the SGLang venv's python: `make sglang`"),
    "CANOPY_VLLM_PYTHON": ("vLLM's CUDA build", "a venv with vLLM's CUDA build: Makefile, `make vllm`'s note"),
}


def commands(part: Part, dry_run: bool) -> list[list[str]]:
    if not dry_run:
        return part.commands
    return part.dry_run or [[*command, "--cpu-dry-run"] for command in part.commands]


def skip_reason(name: str, gpus: int, dry_run: bool = False) -> str | None:
    from canopy.compat import MULTIPROCESS_TORCH, torch_version

    part = PARTS[name]
    if part.gpus > max(gpus, 1):  # one-GPU parts have a CPU dry run
        return f"skipped: {'one GPU' if gpus == 1 else 'no GPU'} (TP, CP and HSDP need 2+)"
    if part.multiprocess and torch_version() < MULTIPROCESS_TORCH:
        return "skipped: torch < 2.13 (TorchTitan 0.3.0's FSDP; canopy/compat.py)"
    if part.python and dry_run:
        return f"skipped: no CPU dry run ({SERVER_VENVS[part.python][0]} serves on GPUs only)"
    if part.python and not os.environ.get(part.python):
        return f"skipped: {part.python} is not set ({SERVER_VENVS[part.python][1]})"
    return None


def results(log: str) -> list[dict]:
    return [json.loads(line[len("RESULT ") :]) for line in log.splitlines() if line.startswith("RESULT ")]


def run_in_group(command: list[str], env: dict, timeout: float) -> tuple[str, int | None]:
    """Run `command` in its own process group; at the timeout the whole group is killed (a part's own children,
    such as the train.py runs it starts, too). Returns its output and exit code (None on timeout)."""
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
            return output.decode(errors="replace"), process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            return output.decode(errors="replace"), None


def run_part(name: str, part: Part, out: Path, dry_run: bool, gpus: int) -> dict:
    reason = skip_reason(name, gpus, dry_run) if name in PARTS else None
    if reason:
        print(f"== {name}: {reason}", flush=True)
        return dict(status="skipped", reason=reason)
    seconds = part.seconds * (DRY_RUN_SLACK if dry_run else 1)
    started, log, status = time.monotonic(), "", "pass"
    # Triton keeps autotuning results on disk, so that fla's kernels are tuned once (kernels), not again per part
    env = {"TRITON_CACHE_AUTOTUNING": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    python = os.environ[part.python] if part.python else PY
    if part.python:  # another venv: the checkout on its path (the bundle's site is this python's)
        env["PYTHONPATH"] = str(ROOT)
    for command in commands(part, dry_run):
        left = seconds - (time.monotonic() - started)
        print(f"== {name}: {' '.join(command)} (timeout {left:.0f} s)", flush=True)
        output, returncode = run_in_group([python, *command], env, max(left, 1))
        log += output
        if returncode is None:
            status = f"timeout ({seconds:g} s)"
            break
        if returncode:
            status = f"fail (exit {returncode})"
            break
    (out / f"{name}.log").write_text(log)
    found = results(log)
    record = dict(status=status, seconds=round(time.monotonic() - started, 1), log=f"{name}.log")
    record["result"] = found[0] if len(found) == 1 else found
    if status != "pass":
        record["tail"] = log[-1500:]
    print(f"   {status}, {record['seconds']} s", flush=True)
    return record


def headline(name: str, result, dry_run: bool = False) -> str:
    """One cell of the report: a part's numbers that matter, from its RESULT."""
    if not result:
        return ""
    if name == "kernels":
        worst = {
            dtype: max(v for k, v in result.items() if k.endswith(dtype) and k.split()[0] != "ours")
            for dtype in ("float32", "bfloat16")
        }
        mfu = result.get("policy MFU")
        return (
            f"largest relative difference fp32 {worst['float32']:.1e}, bf16 {worst['bfloat16']:.1e}; Qwen3.5 "
            f"policy step {result['policy tokens/s']:,.0f} tokens/s, MFU {mfu}"
        )
    if name == "train_step":
        cells = []
        for model, r in result.items():
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
            cells.append(
                f"{model} ({r['params_b']:.2f} B, {r['tokens']:,} tokens): peak {r['measured_gib']['peak']:.2f} GiB "
                f"(plan / measured {r['plan_over_measured']['peak']:.3f}); bf16 {r['bf16_step_s']:.3f} s, "
                f"{r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}"
            )
        return "<br>".join(cells)
    if name == "logprob_head":
        runs = result if isinstance(result, list) else [result]
        return "<br>".join(
            f"vocab {run['vocab']:,}: "
            + ", ".join(
                f"{row['tokens']:,} tokens {row['chunk_gib']:.2f} GiB (plan / measured "
                f"{row['plan_gib'] / row['chunk_gib']:.2f})"
                for row in run["rows"]
            )
            for run in runs
        )
    if name == "engine_gap":
        return f"largest gap {result['largest_gap']:.2e} per action token; per step " + ", ".join(
            f"{gap:.2e}" for gap in result["logprob_gap"]
        )
    if name == "embedded":
        summary = result.get("summary") or {}
        success = f"; success on the training tasks {summary['base']['all']:.3f} -> {summary['final']['all']:.3f}"
        where = "both runs on the CPU" if dry_run else f"{result['cpu_over_device']:.1f}x"
        return (
            f"{result['steps']} steps, {result['step_s']:.2f} s per step against {result['cpu_step_s']:.2f} s on the "
            f"CPU ({where}); reward/success first {result['success_first']:.3f}, last "
            f"{result['success_last']:.3f}" + (success if summary else "")
        )
    return json.dumps(result)[:300]


def report(summary: dict) -> str:
    """The summary as a markdown table (docs/device_check.md)."""
    m = summary["machine"]
    where = f"{m['gpus']} x {m['gpu']} ({m['gpu_memory_gib']} GiB)" if m["gpus"] else f"CPU dry run, {m['cpus']} CPUs"
    lines = [
        f"{m['date']}: {where}, Python {m['python']}, torch {m['torch']}",
        "",
        "| part | status | s | numbers |",
        "|---|---|---|---|",
    ]
    for name, part in summary["parts"].items():
        status = part["status"] if part["status"] != "skipped" else part["reason"]
        numbers = headline(name, part.get("result"), summary["dry_run"])
        lines.append(f"| {name} | {status} | {part.get('seconds', '')} | {numbers} |")
    return "\n".join(lines)


def machine() -> dict:
    import torch

    gpus = torch.cuda.device_count()
    return dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        python=platform.python_version(),
        torch=torch.__version__,
        gpus=gpus,
        gpu=torch.cuda.get_device_name(0) if gpus else None,
        gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if gpus else None,
        cpus=os.cpu_count(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="every part tiny on the CPU")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "device_check")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--report", type=Path, metavar="SUMMARY", help="print a summary.json as markdown, run nothing")
    args = parser.parse_args()
    if args.report:
        return print(report(json.loads(args.report.read_text())))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = dict(machine=machine(), dry_run=args.cpu_dry_run, parts={})
    if not args.cpu_dry_run and not summary["machine"]["gpus"]:
        sys.exit("device_check: no GPU here: run it on the GPU machine, or with --cpu-dry-run")
    print(json.dumps(summary["machine"]), flush=True)
    for name in args.parts:
        summary["parts"][name] = run_part(name, PARTS[name], args.out, args.cpu_dry_run, summary["machine"]["gpus"])
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))  # kept if a later part hangs
    failed = [name for name, part in summary["parts"].items() if part["status"] not in ("pass", "skipped")]
    print(f"summary: {args.out / 'summary.json'}")
    print("DEVICE CHECK: PASS" if not failed else f"DEVICE CHECK: FAIL ({', '.join(failed)})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
