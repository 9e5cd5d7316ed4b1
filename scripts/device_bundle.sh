#!/usr/bin/env bash
# Builds the device bundle: wheels of exactly what the lent GPU machine's image lacks, to travel with the working
# tree (`run`'s carry: 64 MiB with the tree). The image has Python 3.12 with torch 2.11 (CUDA 13), transformers 5.17,
# lightning 2.6, triton, tensorboard, safetensors, tokenizers, einops, numpy, pyyaml, jinja2, httpx, tqdm, pillow.
# What Canopy imports beyond that: TorchTitan (and what its model code imports: spmd_types, torch_checkpointing, tyro
# with its two dependencies), Hydra with OmegaConf and its ANTLR runtime, fla-core, transformers 5.24 (5.17's model
# outputs lack the `.cache` the local engine reads) with the huggingface_hub it checks for on import (5.17 accepts
# hub 1.5, 5.24 needs 1.31), matplotlib (train.py's plots) with its compiled dependencies, and Canopy itself. Versions come from constraints.txt, the set the suite passes with.
#   bash scripts/device_bundle.sh [DIR]           (default .device-bundle; cp312 manylinux wheels, for the device)
#   PYTHON_VERSION=3.11 bash scripts/device_bundle.sh .device-bundle-311   (the same set for this machine's Python:
#                                                  `make device-rehearsal` installs it as the device does)
# Prints the bundle's size (at most 40 MiB) and the line that installs it; scripts/device_check.sh runs that line.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.device-bundle}
PY=${PY:-.venv/bin/python}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
ABI=cp${PYTHON_VERSION/./}
LIMIT_MIB=40

PACKAGES=(torchtitan spmd_types torch_checkpointing tyro docstring-parser typeguard fla-core hydra-core omegaconf
          transformers huggingface_hub matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil)
pinned() {  # the constraints.txt pin of each package (one source of versions)
    for name in "$@"; do
        line=$(grep -i -E "^${name//[-_]/[-_]}==" constraints.txt) || { echo "no pin for $name in constraints.txt" >&2; exit 1; }
        echo "$line"
    done
}

PINS=$(pinned "${PACKAGES[@]}")
ANTLR=$(pinned antlr4-python3-runtime)
rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$PYTHON_VERSION" \
    --abi "$ABI" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$DIR" $PINS
# the ANTLR runtime has only a source release (pure python): build its wheel here
"$PY" -m pip wheel -q --no-deps -w "$DIR" "$ANTLR"
# Canopy itself, from this working tree
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" .
rm -rf build canopy.egg-info

bytes=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
mib=$(awk "BEGIN { printf \"%.1f\", $bytes / 1048576 }")
echo "device bundle: $DIR, $(ls "$DIR"/*.whl | wc -l) wheels, $mib MiB (limit $LIMIT_MIB MiB)"
ls -1 "$DIR" | sed 's/^/  /'
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "the device bundle is over $LIMIT_MIB MiB: drop a package the device already has" >&2
    exit 1
fi
echo "install on the device (scripts/device_check.sh runs it):"
echo "  python -m pip install -q --no-index --no-deps --target .device-site $DIR/*.whl && export PYTHONPATH=\$PWD/.device-site"
