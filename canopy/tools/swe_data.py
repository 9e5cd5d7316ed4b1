"""SWE-bench data for Canopy (Appendix H): convert rows, filter them in the paper's order, cache images, and
generate small SWE-style tasks.

    python -m canopy.tools.swe_data convert rebench|verified ROWS.jsonl OUT.jsonl
    python -m canopy.tools.swe_data filter INSTANCES.jsonl OUT.jsonl --verified VERIFIED.jsonl --tokenizer MODEL_DIR
        [--image-root DIR | --runtime docker] [--materialize skopeo|docker|podman] [--check-gold]
        [--max-prompt-tokens 4096] [--report REPORT.json]
    python -m canopy.tools.swe_data cache-images INSTANCES.jsonl --image-root DIR [--tool skopeo|docker|podman]
    python -m canopy.tools.swe_data generate OUT_DIR [--tasks 8] [--dev 0] [--seed 0] [--docker-base IMAGE]

`convert` writes instances in the format swebench 5.x grades (`image`, `eval_script`, `log_parser`, `eval_type`,
FAIL_TO_PASS / PASS_TO_PASS as lists). SWE-rebench rows carry `install_config` (`test_cmd`, `log_parser`) and
`docker_image`: their eval script is built here, in swebench's shape (test files reset, test patch applied, output
between its markers, the test command's exit status recorded). SWE-bench Verified rows must come from the 5.x
dataset (`SWE-bench/SWE-bench_Verified`, which carries `eval_script`); its image name is swebench's.

`filter` applies Appendix H in order, reporting counts, distinct repos and mean prompt tokens after each stage
(the paper: 5,639 tasks, 1,667 repos, 1,821 mean prompt tokens): (i) the image is materialized on this machine
(`--materialize TOOL` pulls / unpacks it first, as `cache-images` does) and a sandbox starts at `base_commit` (with
`--check-gold`, also: the gold patch resolves and an empty patch does not), (ii) every instance of a repository
that appears in Verified is dropped, (iii) the prompt (mini-swe-agent's messages in the policy's chat template) is
at most 4,096 tokens.

`cache-images` materializes each instance's image before training, so training never pulls: unpacked under an
image root for the bwrap runtime (`skopeo copy` + `umoci unpack`), or pulled into the docker / podman store. It
needs a registry, so it runs on a connected machine.

`generate` writes small SWE-style tasks for tests and the CPU experiment: each a git repository with one bug, a test
patch and a gold patch, its image (the repository only, on the host's /usr: `canopy-image.json` base host), and
FAIL_TO_PASS / PASS_TO_PASS derived by running the tests before and after the gold patch, as SWE-bench validates.
"""

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TEST_FILE = re.compile(r"^diff --git a/(\S+) b/\S+$", re.MULTILINE)
HEREDOC = "EOF_114329324912"  # swebench's own heredoc delimiter for the test patch
VERIFIED_REPOS = (  # the 12 repositories of SWE-bench Verified (Appendix H), used when no Verified file is given
    "astropy/astropy", "django/django", "pallets/flask", "matplotlib/matplotlib", "pylint-dev/pylint",
    "pytest-dev/pytest", "psf/requests", "scikit-learn/scikit-learn", "mwaskom/seaborn", "sphinx-doc/sphinx",
    "sympy/sympy", "pydata/xarray",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- convert


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


def _tests(value) -> list[str]:
    return json.loads(value) if isinstance(value, str) else list(value)


def convert_rebench(row: dict) -> dict:
    """A SWE-rebench row as a swebench 5.x instance."""
    config = row.get("install_config") or {}
    if isinstance(config, str):
        config = json.loads(config)
    if not row.get("docker_image") or not config.get("test_cmd") or not config.get("log_parser"):
        raise ValueError(f"{row.get('instance_id')}: a SWE-rebench row needs docker_image and install_config's "
                         "test_cmd and log_parser (the `filtered` split has them)")  # fmt: skip
    test_cmd = config["test_cmd"] if isinstance(config["test_cmd"], str) else " && ".join(config["test_cmd"])
    conda = [
        "if [ -f /opt/miniconda3/bin/activate ]; then source /opt/miniconda3/bin/activate; conda activate testbed; fi"
    ]
    instance = _common(row)
    instance.update(image=row["docker_image"], log_parser=config["log_parser"], eval_type="pass_and_fail")
    instance["eval_script"] = eval_script(instance, test_cmd, conda + list(config.get("eval_commands") or []))
    return instance


def convert_verified(row: dict) -> dict:
    """A SWE-bench Verified row (5.x dataset) as an instance; its image name is swebench's."""
    from canopy.envs.swe_grading import swebench

    swebench()  # the pinned version, or a loud error
    from swebench.task.checks import expected_image

    missing = [key for key in ("eval_script", "log_parser") if not row.get(key)]
    if missing:
        raise ValueError(f"{row.get('instance_id')}: the row lacks {missing}: use the swebench 5.x dataset "
                         "SWE-bench/SWE-bench_Verified, which carries them")  # fmt: skip
    instance = _common(row)
    instance.update(
        image=row.get("image") or expected_image(row["instance_id"]),
        eval_script=row["eval_script"],
        log_parser=row["log_parser"],
        eval_type=row.get("eval_type") or "pass_and_fail",
    )
    if row.get("difficulty"):
        instance["difficulty"] = row["difficulty"]
    return instance


def _common(row: dict) -> dict:
    keys = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement")
    missing = [key for key in keys if key not in row]
    if missing:
        raise ValueError(f"{row.get('instance_id', '?')}: the row lacks {missing}")
    return {
        **{key: row[key] for key in keys},
        "version": str(row.get("version", "")),
        "hints_text": row.get("hints_text", ""),
        "created_at": str(row.get("created_at", "")),
        "FAIL_TO_PASS": _tests(row["FAIL_TO_PASS"]),
        "PASS_TO_PASS": _tests(row["PASS_TO_PASS"]),
    }


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.partial")
    staging.write_text("".join(json.dumps(row) + "\n" for row in rows))
    staging.replace(path)


# ---------------------------------------------------------------------------------------------------- filter


def stage_report(name: str, instances: list[dict], prompt_tokens: dict[str, int] | None = None) -> dict:
    report = {"stage": name, "instances": len(instances), "repos": len({i["repo"] for i in instances})}
    if prompt_tokens is not None and instances:
        report["mean_prompt_tokens"] = round(
            sum(prompt_tokens[i["instance_id"]] for i in instances) / len(instances), 1
        )
    return report


def materializable(runtime, instance: dict, check_gold: bool) -> str | None:
    """None when the image is here and a sandbox starts at `base_commit` (and, with `check_gold`, the gold patch
    resolves and an empty patch does not); else why not."""
    from canopy.envs.base import EnvironmentFault
    from canopy.envs.runtimes import SandboxError
    from canopy.envs.swe_grading import grade, run_tests, score_log

    if not runtime.has_image(instance["image"]):
        return "image not materialized"
    try:
        sandbox = runtime.start(instance["image"])
        try:
            head = sandbox.run("git rev-parse HEAD", 120).output.strip()
            if head != instance["base_commit"]:
                return f"HEAD {head[:12]} is not base_commit {instance['base_commit'][:12]}"
            if check_gold:
                log, _ = run_tests(sandbox, instance, 1800)
                if score_log(instance, log)[2]:
                    return "an empty patch resolves it"
        finally:
            sandbox.close()
        gold = grade(runtime, instance, instance["patch"], 1800) if check_gold else None
        if gold is not None and gold.outcome != "resolved":
            guarded = f" (the tamper guard restored {', '.join(gold.tampered)})" if gold.tamper else ""
            return f"the gold patch does not resolve it{guarded}"
    except (SandboxError, EnvironmentFault) as error:
        return f"sandbox failed: {error}"
    return None


def prompt_lengths(instances: list[dict], tokenizer_dir: str, template_kwargs: dict) -> dict[str, int]:
    """Tokens of each instance's opening prompt: mini-swe-agent's messages in the policy's chat template."""
    from transformers import AutoTokenizer

    from canopy.envs.swebench import harness
    from canopy.rollout.agent_loop import ChatTokenizer, render_prompt

    tokenizer = ChatTokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), **template_kwargs)
    return {
        i["instance_id"]: len(render_prompt(tokenizer, harness().messages(i["problem_statement"]))) for i in instances
    }


def filter_instances(
    instances: list[dict], runtime, verified_repos: set[str], tokenizer_dir: str, max_prompt_tokens: int = 4096,
    check_gold: bool = False, template_kwargs: dict | None = None, progress=print,
) -> tuple[list[dict], list[dict], dict[str, str]]:  # fmt: skip
    """Appendix H's filters in order; returns (kept instances, a report per stage, why each dropped one went)."""
    dropped: dict[str, str] = {}
    reports = [stage_report("input", instances)]
    kept = []
    for n, instance in enumerate(instances, start=1):
        why = materializable(runtime, instance, check_gold)
        if why is None:
            kept.append(instance)
        else:
            dropped[instance["instance_id"]] = f"(i) {why}"
        if n % 100 == 0 or n == len(instances):
            progress(f"(i) images: {n}/{len(instances)} checked, {len(kept)} kept")
    reports.append(stage_report("(i) image materializable", kept))
    after_dedup = []
    for instance in kept:
        if instance["repo"] in verified_repos:
            dropped[instance["instance_id"]] = f"(ii) repository {instance['repo']} is in SWE-bench Verified"
        else:
            after_dedup.append(instance)
    reports.append(stage_report("(ii) repo-level dedup vs Verified", after_dedup))
    lengths = prompt_lengths(after_dedup, tokenizer_dir, template_kwargs or {})
    final = []
    for instance in after_dedup:
        if lengths[instance["instance_id"]] <= max_prompt_tokens:
            final.append(instance)
        else:
            dropped[instance["instance_id"]] = (
                f"(iii) prompt {lengths[instance['instance_id']]} > {max_prompt_tokens} tokens"
            )
    reports.append(stage_report(f"(iii) prompt <= {max_prompt_tokens} tokens", final, lengths))
    return final, reports, dropped


# ---------------------------------------------------------------------------------------------------- images


def cache_command(image: str, image_root: Path, tool: str) -> list[list[str]]:
    """Commands that put `image` where the runtime finds it without a registry."""
    from canopy.envs.runtimes import safe_image_name

    target = image_root / safe_image_name(image)
    if tool == "skopeo":  # daemonless: an OCI layout, unpacked to an OCI bundle (rootfs/ + config.json)
        layout = image_root / ".oci" / safe_image_name(image)
        return [
            ["skopeo", "copy", f"docker://{image}", f"oci:{layout}:latest"],
            ["umoci", "unpack", "--image", f"{layout}:latest", str(target)],
        ]
    if tool in ("docker", "podman"):  # into the daemon's store
        return [[tool, "pull", image]]
    raise ValueError(f"--tool {tool!r} is unknown: use skopeo, docker or podman")


def cache_images(instances: list[dict], image_root: Path, tool: str, progress=print) -> dict[str, str]:
    """Materialize every distinct image; returns the images that failed, with why."""
    from canopy.envs.runtimes import safe_image_name

    failed = {}
    images = sorted({i["image"] for i in instances})
    for n, image in enumerate(images, start=1):
        if tool == "skopeo" and (image_root / safe_image_name(image) / "rootfs").is_dir():
            continue
        for command in cache_command(image, image_root, tool):
            if shutil.which(command[0]) is None:
                failed[image] = f"{command[0]} is not installed (apt-get install {command[0]})"
                break
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                failed[image] = f"{command[0]}: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
                break
        progress(f"images: {n}/{len(images)}, {len(failed)} failed")
    return failed


# ---------------------------------------------------------------------------------------------------- generate


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
    from canopy.envs.runtimes import safe_image_name

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
    from canopy.envs.runtimes import RuntimeSettings, build_runtime

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
    from canopy.envs.runtimes import safe_image_name

    for instance in instances:
        context = out / "images" / safe_image_name(instance["image"]) / "rootfs"
        dockerfile = f"FROM {base}\nCOPY testbed /testbed\nWORKDIR /testbed\n"
        done = subprocess.run(
            [executable, "build", "-q", "-t", instance["image"], "-f", "-", str(context)],  # no registry needed
            input=dockerfile, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{executable} build {instance['image']}: {done.stderr.strip()[-300:]}")


# ---------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m canopy.tools.swe_data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="SWE-rebench or Verified rows -> swebench 5.x instances")
    convert.add_argument("source", choices=("rebench", "verified"))
    convert.add_argument("rows")
    convert.add_argument("out")
    filt = commands.add_parser("filter", help="Appendix H's filters, in order, with a report")
    filt.add_argument("instances")
    filt.add_argument("out")
    filt.add_argument("--verified", help="Verified instances (their repos are dropped); default: its 12 repos")
    filt.add_argument("--tokenizer", required=True, help="the policy's HF checkpoint directory")
    filt.add_argument("--enable-thinking", action="store_true", help="Table A3 disables thinking")
    filt.add_argument("--max-prompt-tokens", type=int, default=4096)
    filt.add_argument("--image-root", help="unpacked images (bwrap); without it: --runtime")
    filt.add_argument("--runtime", default="auto", choices=("auto", "bwrap", "docker", "podman"))
    filt.add_argument("--check-gold", action="store_true", help="also: the gold patch resolves, an empty one does not")
    filt.add_argument("--materialize", choices=("skopeo", "docker", "podman"), help="pull / unpack the images first")
    filt.add_argument("--report", help="write the stage reports and drop reasons here (JSON)")
    cache = commands.add_parser("cache-images", help="materialize the images so that training never pulls")
    cache.add_argument("instances")
    cache.add_argument("--image-root", required=True)
    cache.add_argument("--tool", default="skopeo", choices=("skopeo", "docker", "podman"))
    gen = commands.add_parser("generate", help="small SWE-style tasks with their images (needs bubblewrap)")
    gen.add_argument("out")
    gen.add_argument("--tasks", type=int, default=8)
    gen.add_argument("--dev", type=int, default=0, help="of which this many go to dev.jsonl")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--docker-base", help="also build each task as a docker image on this base image")
    args = parser.parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731

    if args.command == "convert":
        converter = convert_rebench if args.source == "rebench" else convert_verified
        rows = read_jsonl(args.rows)
        instances, failed = [], []
        for row in rows:
            try:
                instances.append(converter(row))
            except ValueError as error:
                failed.append(str(error))
        write_jsonl(args.out, instances)
        print(
            json.dumps(
                {"rows": len(rows), "converted": len(instances), "failed": len(failed), "first_failure": failed[:1]}
            )
        )
        if not instances:
            sys.exit(f"error: no row converted; first failure: {failed[0] if failed else 'no rows'}")
    elif args.command == "filter":
        from canopy.envs.runtimes import RuntimeSettings, build_runtime, check_runtime

        settings = RuntimeSettings(kind="bwrap" if args.image_root else args.runtime, image_root=args.image_root)
        check_runtime(settings)
        verified = {i["repo"] for i in read_jsonl(args.verified)} if args.verified else set(VERIFIED_REPOS)
        instances = read_jsonl(args.instances)
        if args.materialize:  # stage (i) starts by pulling / unpacking; what fails is dropped by the check below
            cache_images(instances, Path(args.image_root or "."), args.materialize, log)
        kept, reports, dropped = filter_instances(
            instances, build_runtime(settings, tempfile.mkdtemp(prefix="canopy-filter-")), verified,
            args.tokenizer, args.max_prompt_tokens, args.check_gold, {"enable_thinking": args.enable_thinking}, log,
        )  # fmt: skip
        write_jsonl(args.out, kept)
        for report in reports:
            print(json.dumps(report))
        if args.report:
            Path(args.report).write_text(json.dumps({"stages": reports, "dropped": dropped}, indent=2))
    elif args.command == "cache-images":
        failed = cache_images(read_jsonl(args.instances), Path(args.image_root), args.tool, log)
        print(json.dumps({"failed": failed}))
        if failed:
            sys.exit(f"error: {len(failed)} image(s) not materialized; first: {next(iter(failed.items()))}")
    elif args.command == "generate":
        splits = {"train": args.tasks - args.dev, **({"dev": args.dev} if args.dev else {})}
        paths = generate(args.out, args.tasks, args.seed, splits, args.docker_base)
        print(json.dumps({split: str(path) for split, path in paths.items()}))


if __name__ == "__main__":
    main()
