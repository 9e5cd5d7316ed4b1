"""`python -m sglang.launch_server ARGS` with `tests/fake_sglang_launch` on PYTHONPATH: a `FakeSGLang` on `--port`
at `--weight-version`, appending its arguments to `$FAKE_SGLANG_LAUNCHES` (one JSON list per launch)."""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the fakes import each other from there
from fake_sglang import FakeSGLang  # noqa: E402

args = sys.argv[1:]
flags = dict(zip(args[::2], args[1::2]))
with open(os.environ["FAKE_SGLANG_LAUNCHES"], "a") as log:
    log.write(json.dumps(args) + "\n")
server = FakeSGLang(port=int(flags["--port"]))
server.version = flags["--weight-version"]
while True:
    time.sleep(3600)
