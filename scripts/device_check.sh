#!/usr/bin/env bash
# The one command for a lent GPU machine: installs the device bundle (scripts/device_bundle.sh) as its install line
# says, then runs scripts/device_check.py, which writes at most 8 files to $OUT: summary.json and one log per part.
#   bash scripts/device_check.sh                    on the device, from the repository root, with .device-bundle carried
#   PY=... BUNDLE=... bash scripts/device_check.sh --cpu-dry-run   (make device-rehearsal; tests/test_device_check.py)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=.venv/bin/python
BUNDLE=${BUNDLE:-.device-bundle}
OUT=${OUT:-outputs/device_check}
mkdir -p "$OUT"
install() {
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --target .device-site "$BUNDLE"/*.whl
    else  # a python without pip: a wheel is a zip of its modules (its .data, here scripts and man pages, stays out)
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(".device-site") for w in sys.argv[1:]]' "$BUNDLE"/*.whl
    fi
}
if [ -d "$BUNDLE" ]; then
    rm -rf .device-site
    if ! install >"$OUT/install.log" 2>&1; then
        echo "device_check: installing $BUNDLE failed: see $OUT/install.log"
        exit 1
    fi
    export PYTHONPATH=$PWD/.device-site${PYTHONPATH:+:$PYTHONPATH}
    echo "installed $(ls "$BUNDLE"/*.whl | wc -l) wheels from $BUNDLE into .device-site"
fi
exec "$PY" scripts/device_check.py --out "$OUT" "$@"
