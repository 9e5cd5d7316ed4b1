"""SWE-bench instances as the commands read and write them: JSONL files, and the eval script in swebench's shape."""

import json
import re
from pathlib import Path

TEST_FILE = re.compile(r"^diff --git a/(\S+) b/\S+$", re.MULTILINE)
HEREDOC = "EOF_114329324912"  # swebench's own heredoc delimiter for the test patch


def eval_script(instance: dict, test_cmd: str, pre_commands: list[str] = ()) -> str:
    """An eval script in swebench's shape: reset the test files, apply the test patch, run `test_cmd` on them
    between the log markers, record its exit status after the end marker, reset the test files again."""
    from canopy.envs.swe_grading import swebench

    c = swebench().constants
    base, files = instance["base_commit"], " ".join(TEST_FILE.findall(instance["test_patch"]))
    lines = [
        "#!/bin/bash",
        "set -uxo pipefail",
        "cd /testbed",
        *pre_commands,
        f"git checkout {base} {files}",
        f"git apply -v - <<'{HEREDOC}'\n{instance['test_patch']}\n{HEREDOC}",
        f": '{c.START_TEST_OUTPUT}'",
        f"{test_cmd} {files}",
        f"{c.TEST_EXIT_CODE_VAR}=$?",
        f": '{c.END_TEST_OUTPUT}'",
        f'echo "{c.TEST_EXIT_CODE}: ${c.TEST_EXIT_CODE_VAR}"',
        f"git checkout {base} {files}",
    ]
    return "\n".join(lines) + "\n"


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.partial")
    staging.write_text("".join(json.dumps(row) + "\n" for row in rows))
    staging.replace(path)
