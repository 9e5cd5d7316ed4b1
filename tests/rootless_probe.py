"""Run by tests/test_swebench.py as an unprivileged user (the system python, stdlib only): a bubblewrap sandbox
without root, in a user namespace. Prints what each command returned, as JSON."""

import json
import sys

from canopy.envs.isolation import RuntimeSettings, check_runtime
from canopy.envs.isolation.bubblewrap import BwrapRuntime

root, image = sys.argv[1], sys.argv[2]
settings = RuntimeSettings(kind="bwrap", image_root=f"{root}/images", memory_mb=256)
check_runtime(settings)
runtime = BwrapRuntime(settings, f"{root}/scratch")
sandbox = runtime.start(image)
out = {}
for name, command in {
    "head": "git rev-parse HEAD",
    "write": "echo hello > notes.txt && cat notes.txt",
    "persist": "cat notes.txt; git status --short",
    "usr": "echo x > /usr/escape",
    "net": "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"",
    "memory": "python3 -c 'x = bytearray(600 * 2**20)'",
}.items():
    result = sandbox.run(command, 20)
    out[name] = [result.returncode, result.output]
sandbox.close()
out["rootless"], out["cgroups"] = runtime.rootless, runtime.cgroups
print(json.dumps(out))
