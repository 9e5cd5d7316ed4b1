"""The device command (scripts/device_check.sh) runs every part tiny on the CPU, writes at most 8 files, and reports
failures and timeouts per part; the device bundle is built under its size limit with the install line printed."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import device_check  # noqa: E402


@pytest.mark.slow
def test_the_device_command_dry_run_passes_every_part_in_at_most_8_files(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PY=sys.executable, BUNDLE=str(tmp_path / "no-bundle"), OUT=str(out))
    done = subprocess.run(
        ["bash", "scripts/device_check.sh", "--cpu-dry-run"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "DEVICE CHECK: PASS"
    files = sorted(path.name for path in out.iterdir())
    assert len(files) <= 8 and "summary.json" in files, files
    summary = json.loads((out / "summary.json").read_text())
    parts = summary["parts"]
    assert set(parts) == set(device_check.PARTS)
    skipped = {"status": "skipped", "reason": "skipped: no GPU (TP, CP and HSDP need 2+)"}
    assert parts["parallel"] == parts["parallel_qwen3_5"] == skipped
    assert parts["sglang"]["status"] == parts["vllm"]["status"] == "skipped"
    ran = {name: part["status"] for name, part in parts.items() if part["status"] != "skipped"}
    assert ran == dict.fromkeys(["kernels", "train_step", "logprob_head", "engine_gap", "embedded"], "pass"), parts

    kernels = parts["kernels"]["result"]  # (a) our Gated DeltaNet against transformers' torch kernels on the CPU
    differences = {k: v for k, v in kernels.items() if k.split()[0] in ("out", "dq", "dk", "dv", "dg", "dbeta", "conv")}
    assert len(differences) == 14 and max(differences.values()) < 5e-2 and kernels["failed"] == []

    for model, step in parts["train_step"]["result"].items():  # (b) the plan against the measured step
        ratio = step["plan_over_measured"]
        assert all(ratio[t] == pytest.approx(1.0) for t in ("weights", "gradients", "optimizer", "reference")), model
        assert 0.85 < ratio["activations"] < 1.15 and 0.9 < ratio["peak"] < 1.25, (model, ratio)
        assert step["tokens_per_s"] > 0 and step["mfu"] is None

    head = parts["logprob_head"]["result"]  # (c) the chunked head's peak against the plan
    assert [row["tokens"] for row in head["rows"]] == [256, 512]
    assert all(0.5 < row["plan_gib"] / row["chunk_gib"] < 1.5 for row in head["rows"]), head
    assert head["rows"][0]["agree"]

    gap = parts["engine_gap"]["result"]  # (d) bf16 engine against the float32 trainer: small, but not zero
    assert len(gap["logprob_gap"]) == 2 and 0 < gap["largest_gap"] < 0.05

    learn = parts["embedded"]["result"]  # (e) a short embedded run and its CPU baseline, read back from the logs
    assert learn["steps"] == 3 and learn["step_s"] > 0 and learn["cpu_step_s"] > 0
    assert set(learn["summary"]) >= {"base", "final"}

    table = device_check.report(summary).splitlines()  # docs/device_check.md's table
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"part", *device_check.PARTS}
    assert "| train_step | pass |" in rows["train_step"] and "plan / measured" in rows["train_step"]


def part(seconds: int, code: str) -> device_check.Part:
    return device_check.Part(seconds, [["-c", code]])


def test_a_failing_part_and_a_hung_one_are_reported_and_their_children_killed(tmp_path):
    ok = device_check.run_part("ok", part(30, 'print("RESULT {\\"x\\": 1}")'), tmp_path, False, 1)
    assert ok["status"] == "pass" and ok["result"] == {"x": 1}
    failed = device_check.run_part("bad", part(30, "import sys; print('why'); sys.exit(3)"), tmp_path, False, 1)
    assert failed["status"] == "fail (exit 3)" and "why" in failed["tail"]
    marker = tmp_path / "child-lived"
    child = tmp_path / "child.py"
    child.write_text(f"import time\ntime.sleep(3)\nopen({str(marker)!r}, 'w')\n")
    # a part whose child outlives it would go on holding the GPU after its timeout
    hang = f"import subprocess, sys, time; subprocess.Popen([sys.executable, {str(child)!r}]); time.sleep(60)"
    started = time.monotonic()
    hung = device_check.run_part("hung", part(1, hang), tmp_path, False, 1)
    assert hung["status"] == "timeout (1 s)" and time.monotonic() - started < 10
    time.sleep(4)
    assert not marker.exists(), "the part's child survived its timeout"
    assert (tmp_path / "hung.log").exists()


def test_parts_that_cannot_run_here_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.delenv("CANOPY_SGLANG_PYTHON", raising=False)
    monkeypatch.delenv("CANOPY_VLLM_PYTHON", raising=False)
    assert device_check.skip_reason("parallel", 1) == "skipped: one GPU (TP, CP and HSDP need 2+)"
    assert device_check.skip_reason("parallel", 8) is None
    assert "CANOPY_SGLANG_PYTHON is not set" in device_check.skip_reason("sglang", 8)
    monkeypatch.setenv("CANOPY_SGLANG_PYTHON", "/opt/sglang/bin/python")
    assert device_check.skip_reason("sglang", 1) is None
    assert "no CPU dry run" in device_check.skip_reason("sglang", 0, dry_run=True)
    assert "CANOPY_VLLM_PYTHON is not set (a venv with vLLM's CUDA build" in device_check.skip_reason("vllm", 8)
    monkeypatch.setenv("CANOPY_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert device_check.skip_reason("vllm", 1) is None
    assert "vLLM's CUDA build serves on GPUs only" in device_check.skip_reason("vllm", 0, dry_run=True)
    monkeypatch.setattr("canopy.compat.version", lambda package: "2.11.0+cu130")
    assert "torch < 2.13" in device_check.skip_reason("parallel_qwen3_5", 8)
    assert device_check.skip_reason("kernels", 1) is None


def test_the_device_bundle_fits_its_limit_and_prints_its_install_line(tmp_path):
    done = subprocess.run(
        ["bash", "scripts/device_bundle.sh", str(tmp_path / "bundle")],
        cwd=ROOT,
        env=dict(os.environ, PY=sys.executable),
        capture_output=True,
        text=True,
    )
    if done.returncode and "Could not find" in done.stderr + done.stdout:
        pytest.fail("device_bundle.sh could not download its wheels: it needs the package index (pip download)")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    wheels = sorted(path.name for path in (tmp_path / "bundle").iterdir())
    names = {wheel.split("-")[0].lower() for wheel in wheels}
    assert {"canopy", "torchtitan", "hydra_core", "omegaconf", "antlr4_python3_runtime", "fla_core"} <= names
    assert {"transformers", "huggingface_hub"} <= names  # 5.24 for the engine, and the hub it checks for
    assert not names & {"torch", "lightning", "triton", "tokenizers", "safetensors"}, "the device has these"
    assert all("cp312" in wheel or "py3-none-any" in wheel or "abi3" in wheel for wheel in wheels), wheels
    size = sum(path.stat().st_size for path in (tmp_path / "bundle").iterdir())
    assert size < 40 * 2**20
    assert f"{size / 2**20:.1f} MiB (limit 40 MiB)" in done.stdout
    assert f"--no-index --no-deps --target .device-site {tmp_path / 'bundle'}/*.whl" in done.stdout


def test_the_one_gpu_parts_fit_the_lent_machines_8_minutes():
    one_gpu = [part for part in device_check.PARTS.values() if part.gpus == 1 and not part.python]
    assert sum(part.seconds for part in one_gpu) <= 8 * 60


def test_random_models_are_built_on_the_device_asked_for():
    """The training-step part builds its models where it measures them (a model left on the CPU would fail the
    GPU run, or be measured in the wrong memory)."""
    import device_train_step

    from canopy.tools.memory_measure import _random_model

    for hf, *_ in device_train_step.CPU_MODELS.values():
        model = _random_model(hf, "meta")
        assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    hf = device_train_step.GPU_MODELS["qwen3_5-4b"][0]  # the real shapes, counted without memory
    params, flops_per_token = device_train_step.flops_per_token(hf, 8192)
    assert 3.5e9 < params < 4.5e9 and flops_per_token > 4 * params  # 6 N without the embeddings, + attention


@pytest.mark.parametrize("script, variable", [("gpu_check_sglang.py", "SGLANG"), ("gpu_check_vllm.py", "VLLM")])
def test_the_server_checks_import_here_and_refuse_a_machine_without_a_gpu_in_one_line(script, variable):
    env = {**os.environ, "PYTHONPATH": str(ROOT), f"CANOPY_{variable}_PYTHON": sys.executable}
    done = subprocess.run(
        [sys.executable, f"scripts/{script}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr[-2000:]
    first = done.stdout.splitlines()[0]
    assert first.startswith(f"FAIL setup: needs CANOPY_{variable}_PYTHON") and first.endswith("and a CUDA GPU")
