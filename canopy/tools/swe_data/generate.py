"""`generate` writes small SWE-style tasks for tests and the CPU experiment: each a git repository with one bug, a test
patch and a gold patch, its image (the repository only, on the host's /usr: `canopy-image.json` base host), and
FAIL_TO_PASS / PASS_TO_PASS derived by running the tests before and after the gold patch, as SWE-bench validates.
"""

import json
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from canopy.tools.swe_data.instances import eval_script, write_jsonl


@dataclass(frozen=True)
class Bug:
    """A function of the generated package, its correct and buggy bodies, the issue text and two tests."""

    name: str
    params: str
    good: str
    bad: str
    issue: str
    tests: tuple[str, str]


BUGS = [
    Bug("add", "a, b", "return a + b", "return a - b", "`add(a, b)` subtracts instead of adding.",
        ("assert add(2, 3) == 5", "assert add(-1, 1) == 0")),
    Bug("is_even", "n", "return n % 2 == 0", "return n % 2 == 1", "`is_even(n)` answers True for odd numbers.",
        ("assert is_even(4)", "assert not is_even(7)")),
    Bug("last", "items", "return items[-1]", "return items[-2]", "`last(items)` returns the second-to-last element.",
        ("assert last([1, 2, 3]) == 3", "assert last(['x']) == 'x'")),
    Bug("clamp", "x, lo, hi", "return max(lo, min(x, hi))", "return min(lo, max(x, hi))",
        "`clamp(x, lo, hi)` does not keep x in [lo, hi].",
        ("assert clamp(5, 0, 3) == 3", "assert clamp(-2, 0, 3) == 0")),
    Bug("mean", "xs", "return sum(xs) / len(xs)", "return sum(xs) / (len(xs) + 1)",
        "`mean(xs)` is too small: it divides by one too many.", ("assert mean([2, 4]) == 3", "assert mean([5]) == 5")),
    Bug("shout", "text", "return text.upper() + '!'", "return text.lower() + '!'",
        "`shout(text)` lower-cases the text instead of upper-casing it.",
        ("assert shout('hi') == 'HI!'", "assert shout('Ok') == 'OK!'")),
    Bug("count_vowels", "s", "return sum(c in 'aeiou' for c in s.lower())",
        "return sum(c in 'aeio' for c in s.lower())",
        "`count_vowels(s)` misses the letter u.",
        ("assert count_vowels('unicorn') == 3", "assert count_vowels('AU') == 2")),
    Bug("reverse_words", "s", "return ' '.join(reversed(s.split()))", "return ' '.join(s.split())",
        "`reverse_words(s)` does not reverse the word order.",
        ("assert reverse_words('a b c') == 'c b a'", "assert reverse_words('one') == 'one'")),
]  # fmt: skip
TEST_CMD = "python3 -m pytest -rA --tb=no -p no:cacheprovider"
RUNNER = "python3 tests/runtests.py"  # the runner-script tasks' test command, as Django's tests/runtests.py
RUNNER_SCRIPT = f"""\"\"\"The repository's own test runner: pytest on the test files it is given.\"\"\"
import sys

import pytest

sys.exit(pytest.main({TEST_CMD.split()[3:]!r} + sys.argv[1:]))
"""
EDITABLE = "export PYTHONPATH=/testbed  # the repository on sys.path from the start, as an editable install puts it"
GIT_ENV = {"HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin"}
for role in ("AUTHOR", "COMMITTER"):  # fixed identity and date: the same seed gives the same commits
    GIT_ENV.update({f"GIT_{role}_NAME": "canopy", f"GIT_{role}_EMAIL": "canopy@localhost"})
    GIT_ENV[f"GIT_{role}_DATE"] = "2026-01-01T00:00:00Z"


def _git(repo: Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo}: {done.stderr.strip()}")
    return done.stdout


def _module(functions: list[Bug], buggy: str | None) -> str:
    return "\n\n".join(f"def {f.name}({f.params}):\n    {f.bad if f.name == buggy else f.good}\n" for f in functions)


def _diff(repo: Path, path: str, text: str) -> str:
    """The diff that writes `text` to `path` in `repo`'s work tree, left unchanged."""
    target = repo / path
    before = target.read_text() if target.exists() else None
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    _git(repo, "add", "-N", path)
    diff = _git(repo, "diff", "--", path)
    _git(repo, "reset", "-q", "--", path)
    if before is None:
        target.unlink()
    else:
        target.write_text(before)
    return diff


def generate_task(out: Path, index: int, rng: random.Random) -> dict:
    """One task: its image (a git repo at the buggy commit) under out/images, and its instance (no tests yet).
    Every fourth task from the third runs its tests through the repository's own runner script; every fourth from
    the fourth has its new tests in a new file of the test patch (old tests unrun: no PASS_TO_PASS)."""
    from canopy.envs.isolation import safe_image_name

    bug = BUGS[index % len(BUGS)]
    others = [b for b in BUGS if b is not bug]
    functions = [bug] + rng.sample(others, 3)
    rng.shuffle(functions)
    package = f"toolkit{index}"
    instance_id = f"canopy-toy__{package}-{index}"
    image = f"canopy/sweb.eval.toy.{package}:latest"
    image_dir = out / "images" / safe_image_name(image)
    if image_dir.exists():
        shutil.rmtree(image_dir)
    repo = image_dir / "rootfs" / "testbed"
    repo.mkdir(parents=True)
    (image_dir / "canopy-image.json").write_text(json.dumps({"base": "host"}))
    (repo / package).mkdir()
    (repo / package / "__init__.py").write_text(f"from {package}.core import *  # noqa\n")
    (repo / package / "core.py").write_text(_module(functions, buggy=bug.name))
    (repo / "tests").mkdir()
    existing = [f for f in functions if f is not bug]
    imports = f"from {package} import {', '.join(f.name for f in existing)}\n"
    old_tests = "\n".join(
        f"\ndef test_{f.name}_{k}():\n    {check}\n" for f in existing for k, check in enumerate(f.tests)
    )
    (repo / "tests" / "test_core.py").write_text(f"{imports}\n{old_tests}")
    runner, new_file = index % 4 == 2, index % 4 == 3
    if runner:
        (repo / "tests" / "runtests.py").write_text(RUNNER_SCRIPT)
    (repo / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{package}: initial version")
    base_commit = _git(repo, "rev-parse", "HEAD").strip()
    name = bug.name  # the test patch adds the bug's tests to the existing test file: its old tests are PASS_TO_PASS
    new_tests = "\n".join(f"\ndef test_{name}_behaviour_{k}():\n    {check}\n" for k, check in enumerate(bug.tests))
    if new_file:
        test_patch = _diff(repo, f"tests/test_{name}.py", f"from {package} import {name}\n\n{new_tests}")
    else:
        test_patch = _diff(
            repo, "tests/test_core.py", f"{imports}from {package} import {name}\n\n{old_tests}{new_tests}"
        )
    gold_patch = _diff(repo, f"{package}/core.py", _module(functions, buggy=None))
    instance = {
        "instance_id": instance_id,
        "repo": f"canopy-toy/{package}",
        "base_commit": base_commit,
        "patch": gold_patch,
        "test_patch": test_patch,
        "problem_statement": f"Bug in {package}: {bug.issue} Please fix it in {package}/core.py.",
        "version": "0.1",
        "hints_text": "",
        "created_at": "2026-01-01",
        "image": image,
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "FAIL_TO_PASS": [],
        "PASS_TO_PASS": [],
    }
    instance["eval_script"] = eval_script(instance, RUNNER if runner else TEST_CMD, [EDITABLE])
    return instance


def derive_tests(runtime, instance: dict) -> dict:
    """FAIL_TO_PASS / PASS_TO_PASS from the tests' status before and after the gold patch (SWE-bench's validation)."""
    from canopy.envs.swe_grading import apply_patch, run_tests, swebench, test_status

    sb = swebench()
    status = []
    for patch in (None, instance["patch"]):
        sandbox = runtime.start(instance["image"])
        try:
            if patch is not None and not apply_patch(sandbox, patch, 120)[0]:
                raise RuntimeError(f"{instance['instance_id']}: the gold patch does not apply")
            log, _ = run_tests(sandbox, instance, 600)
        finally:
            sandbox.close()
        status.append(test_status(instance, log))
    before, after = status
    passed = sb.constants.TestStatus.PASSED.value
    f2p = sorted(t for t, s in after.items() if s == passed and before.get(t) != passed)
    p2p = sorted(t for t, s in after.items() if s == passed and before.get(t) == passed)
    if not f2p:
        raise RuntimeError(
            f"{instance['instance_id']}: no test fails before the gold patch and passes after: {before} {after}"
        )
    return {**instance, "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p}


def generate(
    out: str | Path, tasks: int, seed: int = 0, splits: dict[str, int] | None = None, container_base: str | None = None
) -> dict[str, Path]:
    """`tasks` generated tasks under `out` (images/ and one JSONL per split; with `container_base`, also built as
    docker images on that base); returns split -> JSONL path."""
    from canopy.envs.isolation import RuntimeSettings, build_runtime

    out = Path(out)
    rng = random.Random(seed)
    runtime = build_runtime(RuntimeSettings(kind="bwrap", image_root=str(out / "images"), memory_mb=2048))
    instances = [derive_tests(runtime, generate_task(out, i, rng)) for i in range(tasks)]
    if container_base is not None:
        build_container_images(out, instances, container_base)
    splits = splits or {"train": tasks}
    paths, start = {}, 0
    for split, count in splits.items():
        paths[split] = out / f"{split}.jsonl"
        write_jsonl(paths[split], instances[start : start + count])
        start += count
    return paths


def build_container_images(out: Path, instances: list[dict], base: str, executable: str = "docker") -> None:
    """Each generated task as a container image too: `base` (an image with bash, git, python3 and pytest, e.g. a
    `debootstrap` root file system `docker import`ed) plus the task's `/testbed`, built without a registry."""
    from canopy.envs.isolation import safe_image_name

    for instance in instances:
        context = out / "images" / safe_image_name(instance["image"]) / "rootfs"
        dockerfile = f"FROM {base}\nCOPY testbed /testbed\nWORKDIR /testbed\n"
        done = subprocess.run(
            [executable, "build", "-q", "-t", instance["image"], "-f", "-", str(context)],  # no registry needed
            input=dockerfile, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{executable} build {instance['image']}: {done.stderr.strip()[-300:]}")
