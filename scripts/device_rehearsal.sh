#!/usr/bin/env bash
# `make device-rehearsal`: the lent GPU machine's setup, rehearsed on this one, so that its 15 minutes are not spent
# failing setup. Not part of `make test` (it installs a second torch, about 5 GB with the CUDA libraries).
#  1. a venv with what the device image has: torch 2.11.0 (the PyPI build, CUDA 13, run on the CPU: the CPU-only
#     build lives on download.pytorch.org, out of reach here), transformers 5.17 with the oldest huggingface_hub it
#     accepts (the image's is not known), lightning 2.6.6, triton 3.6, tensorboard, safetensors, tokenizers, einops;
#  2. the device bundle for this machine's python (the same packages and versions; only the compiled wheels' tags
#     differ from the device's cp312 bundle), installed by scripts/device_check.sh exactly as on the device;
#  3. the device command's CPU dry run, then a 3-step `train.py` on that install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${REHEARSAL_VENV:-.venv-rehearsal}
SYSTEM_PYTHON=${SYSTEM_PYTHON:-python3}
OUT=${OUT:-outputs/device_rehearsal}
IMAGE=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 huggingface_hub==1.5.0 lightning==2.6.6 tensorboard
       safetensors tokenizers einops)

if [ "$(cat "$VENV/.canopy-installed" 2>/dev/null)" != "${IMAGE[*]}" ]; then
    rm -rf "$VENV"
    "$SYSTEM_PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "${IMAGE[@]}"
    echo "${IMAGE[*]}" > "$VENV/.canopy-installed"
fi
PYTHON_VERSION=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PYTHON_VERSION=$PYTHON_VERSION bash scripts/device_bundle.sh .device-bundle-rehearsal
rm -rf "$OUT"
PY=$VENV/bin/python BUNDLE=.device-bundle-rehearsal OUT=$OUT bash scripts/device_check.sh --cpu-dry-run
echo "== train.py, 3 steps, on torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
PYTHONPATH=$PWD/.device-site "$VENV/bin/python" train.py trainer.max_steps=3 "hydra.run.dir=$OUT/train"
echo "DEVICE REHEARSAL: PASS"
