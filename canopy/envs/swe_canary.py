"""The canary of SWE-bench grading: a test that must fail, planted among the task's own tests.

The code under test runs inside the test process, where no file guard reaches (`canopy.envs.swe_guard`): a patch to
the package can rewrite pytest's reports from its own import. So for instances graded by a pytest log parser, a
failing test is planted in each Python test file of the test patch, and a run that does not report every canary
FAILED was tampered with, by whatever means, and is scored unresolved:
- one reported passed (the reports were rewritten);
- one not reported failed while the instance resolves (the rewrite spared it, the run ended early, or the test patch
  did not apply and the patch's own tests of the same names ran in its place).

The patch's code can read the test files and the eval script, so the canary hides among the tests it sits with:
- named like them, a sibling of one of the file's test names (`test_add_0` -> `test_add_3`), never a fixed shape;
- at a random place among the file's top-level statements;
- inside the test patch of the eval script, not planted by a command of its own (the patch never saw the original
  test patch, so nothing there marks which test was added);
- failing by a plain assertion.
What stays out of reach: a rewrite that passes exactly the task's own test names (a policy would have to learn
them over many steps) or that recognises a bound-to-fail body (docs/reward_integrity.md).

The test patch with its canaries is built with git in the fresh grading sandbox, before the submitted patch is
applied: the test patch applied to a scratch index of `base_commit`, each canary written as a blob beside it, and
the scratch index diffed against `base_commit`.
"""

import ast
import hashlib
import random
import re
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath

from canopy.envs.swe_guard import GUARD as FOLDER
from canopy.envs.swe_guard import HEREDOC, TEST_PATCH_FILE, run_checked

PARSERS = ("parse_log_pytest", "parse_log_pytest_options", "parse_log_pytest_v2")
PYTHON_TEST_FILE = re.compile(r"(^|/)(test_[^/]*|[^/]*_test)\.py$")
TEST_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(test\w*)[ \t]*\(", re.MULTILINE)
IDENTIFIER = re.compile(r"\w+")
WORDS = ("value", "name", "item", "text", "count", "key", "path", "size", "token", "label")


@dataclass(frozen=True)
class Canary:
    """The planted tests, as (test file, test name), and the eval script whose test patch carries them."""

    tests: tuple[tuple[str, str], ...]
    eval_script: str

    def reported(self, status: dict[str, str]) -> list[str]:
        """Each canary's status in a log parser's `status` map ("" when it is not reported)."""
        found = []
        for path, name in self.tests:
            statuses = [s for test, s in status.items() if test.split("::")[-1] == name and path in test]
            found.append(statuses[-1] if statuses else "")
        return found


def sibling_name(source: str, path: str, rng: random.Random) -> str:
    """A new test name like the file's own: one of them with another number (`test_add_0` -> `test_add_2`), or the
    file's stem numbered when it has none; never a name the file already uses."""
    names = TEST_DEF.findall(source)
    taken = set(IDENTIFIER.findall(source))
    base = rng.choice(names) if names else "test_" + re.sub(r"^test_|_test$", "", PurePosixPath(path).stem)
    stem = re.sub(r"_?\d+$", "", base) or base
    separator = "" if re.search(r"[^_\d]\d+$", base) else "_"
    numbered = [
        int(n[len(stem) + len(separator) :]) for n in names if re.fullmatch(rf"{re.escape(stem + separator)}\d+", n)
    ]
    numbers = list(range(max(numbered, default=-1) + 3))  # beside its siblings' numbers
    rng.shuffle(numbers)
    for number in numbers + list(range(len(numbers), len(numbers) + len(taken) + 1)):
        if f"{stem}{separator}{number}" not in taken:
            return f"{stem}{separator}{number}"
    raise AssertionError("unreachable: more numbers were tried than names taken")


def false_assertion(rng: random.Random) -> str:
    """An assertion that fails, in one of a few ordinary shapes."""
    a, b, word = rng.randint(2, 99), rng.randint(2, 99), rng.choice(WORDS)
    items = rng.sample(range(1, 10), 3)
    return rng.choice(
        [
            f"assert {a} + {b} == {a + b + rng.randint(1, 9)}",
            f"assert {a} * {b} == {a * b - rng.randint(1, 9)}",
            f"assert sorted({items!r}) == {sorted(items, reverse=True)!r}",
            f"assert {word!r}.upper() == {word!r}",
            f"assert len({word!r}) == {len(word) + rng.randint(1, 3)}",
        ]
    )


def insertion_lines(source: str) -> list[int]:
    """The line indexes before which a test function may go: each top-level statement after the module's docstring
    and its imports (before its decorators), and the end of the file."""
    end = len(source.splitlines())
    try:
        body = ast.parse(source).body
    except (SyntaxError, ValueError):
        return [end]
    first = int(bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant))
    while first < len(body) and isinstance(body[first], (ast.Import, ast.ImportFrom)):
        first += 1
    starts = [min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))]) - 1 for node in body[first:]]
    return sorted(set(starts)) + [end]


def planted_source(source: str, path: str, rng: random.Random) -> tuple[str, str]:
    """`source` with a canary test inserted at a random top-level place; (the new source, the canary's name)."""
    name = sibling_name(source, path, rng)
    block = f"def {name}():\n    {false_assertion(rng)}\n"
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    places = insertion_lines(source)
    rng.shuffle(places)
    parses = _parses(source)
    for at in [*places, len(lines)]:
        before, after = lines[:at], lines[at:]
        blank_before = len(before) - len("".join(before).rstrip("\n").splitlines(keepends=True)) if before else 2
        blank_after = len(after) - len("".join(after).lstrip("\n").splitlines(keepends=True)) if after else 2
        new = (
            "".join(before) + "\n" * max(0, 2 - blank_before) + block + "\n" * max(0, 2 - blank_after) + "".join(after)
        )
        if not parses or _parses(new):
            return new, name
    raise AssertionError("unreachable: a function appended to a module that parses still parses")


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def blob_id(data: bytes, length: int) -> str:
    """git's object id of a blob (SHA-1, or SHA-256 for a repository of that format: `length` 64)."""
    digest = hashlib.sha1 if length == 40 else hashlib.sha256
    return digest(b"blob %d\0" % len(data) + data).hexdigest()


def plant(sandbox, instance: dict, timeout: float, rng: random.Random | None = None) -> Canary | None:
    """The instance's eval script with a canary in each Python test file of its test patch (see the module
    docstring), built in `sandbox` before the submitted patch is applied; None where the instance's runner or script
    shape allows none (not a pytest log parser, no Python test file, no test patch applied from a here-document, a
    test file that is not UTF-8 text)."""
    rng = rng or random.SystemRandom()
    files = sorted({b for _, b in TEST_PATCH_FILE.findall(instance["test_patch"]) if PYTHON_TEST_FILE.search(b)})
    heredoc = _heredoc(instance["eval_script"])
    if instance.get("log_parser") not in PARSERS or not files or heredoc is None:
        return None
    setup, git = f"cd /testbed && export GIT_INDEX_FILE={FOLDER}/canary.index", "git -c core.hooksPath=/dev/null"
    _run(sandbox, f"mkdir -p {FOLDER} && cat > {FOLDER}/test.patch", timeout, instance["test_patch"].encode())
    apply = f"{setup} && {git} read-tree {instance['base_commit']} && {git} apply --cached {FOLDER}/test.patch"
    _run(sandbox, apply, timeout)  # its warnings (whitespace...) stay out of the listing
    listing = _run(sandbox, f"{setup} && {git} ls-files -s -z -- {shlex.join(files)}", timeout)
    planted = []
    for record in filter(None, listing.split("\0")):
        meta, _, path = record.partition("\t")
        mode, blob, _ = meta.split()
        text = _run(sandbox, f"{setup} && {git} cat-file blob {blob}", timeout)
        if blob_id(text.encode(), len(blob)) != blob:
            continue  # not UTF-8, or past the runtime's output cap: the host cannot hand it back intact
        new, name = planted_source(text, path, rng)
        written = f"$({git} hash-object -w --stdin)"
        _run(
            sandbox,
            f"{setup} && {git} update-index --cacheinfo {mode},{written},{shlex.quote(path)}",
            timeout,
            new.encode(),
        )
        planted.append((path, name))
    if not planted:
        return None
    diff = "diff --cached --binary --no-ext-diff --no-textconv --no-color --no-renames --src-prefix=a/ --dst-prefix=b/"
    patch = _run(
        sandbox,
        f"{setup} && {git} {diff} {instance['base_commit']} 2>/dev/null; status=$?; rm -f {FOLDER}/canary.index; "
        "exit $status",
        timeout,
    )
    start, end = heredoc
    lines = instance["eval_script"].split("\n")
    if lines[end].strip() in patch.split("\n") or "[canopy: " in patch:
        return None  # the delimiter inside the patch, or a patch past the runtime's output cap
    return Canary(tuple(planted), "\n".join(lines[: start + 1] + patch.rstrip("\n").split("\n") + lines[end:]))


def _heredoc(script: str) -> tuple[int, int] | None:
    """(the `git apply ... <<DELIM` line, its DELIM line) of the eval script's test patch, or None."""
    lines = script.split("\n")
    for start, line in enumerate(lines):
        found = HEREDOC.search(line) if "git apply" in line else None
        end = next((i for i in range(start + 1, len(lines)) if found and lines[i].strip() == found.group(1)), None)
        if end is not None:
            return start, end
    return None


def _run(sandbox, command: str, timeout: float, stdin: bytes | None = None) -> str:
    return run_checked(sandbox, command, timeout, stdin, "canary", "git")
