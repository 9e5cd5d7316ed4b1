"""Grading a submitted patch the way swebench 5.x does (Appendix H), in a fresh sandbox of the task's image.

swebench's own code decides: its apply chain (`GIT_APPLY_CMDS`, read from the installed package's source), its
log markers and `get_logs_eval`, its log parsers (`PARSER_REGISTRY`), `get_eval_tests_report` and
`get_resolution_status`, and `infra_failure.classify_text` for infrastructure-failure signatures. Importing
`swebench.harness` pulls docker, datasets and modal; `swebench()` imports only the grading modules, behind an
empty `swebench.harness` package, and fails loudly if the pinned version changes shape.

Outcomes (Table A3): `resolved` 1; `unresolved` (tests fail, error or hang) 0; `empty_patch` and
`patch_apply_failed` -> the no-patch reward. What the patch may not change about its test run is put back first
(`canopy.envs.swe_guard`), a canary must be reported failed (`canopy.envs.swe_canary`), and a log with more than one
start or end marker was written to by the tests' processes: both are scored unresolved. A grading is the serving
layer's fault (`EnvironmentFault`, quarantined) only on evidence the patch cannot produce (`grade`).
"""

import ast
import functools
import importlib
import importlib.util
import sys
import tempfile
import types
from dataclasses import dataclass, replace
from pathlib import Path

from canopy.envs.base import EnvironmentFault
from canopy.envs.isolation import SandboxError
from canopy.envs.swe_canary import plant
from canopy.envs.swe_guard import TamperGuard

SWEBENCH_VERSION = "5.0.2"
PATCH_PATH = "/tmp/canopy-submission.patch"
EVAL_PATH = "/tmp/canopy-eval.sh"
RESET = "git checkout -- . ; git clean -fd"  # between apply attempts, as swebench's harness resets


@functools.cache
def swebench() -> types.SimpleNamespace:
    """swebench's grading modules, imported without `swebench.harness.__init__` (see the module docstring)."""
    spec = importlib.util.find_spec("swebench")
    if spec is None:
        raise ImportError(f"swebench is not installed: pip install --no-deps swebench=={SWEBENCH_VERSION} unidiff")
    import swebench as package

    if package.__version__ != SWEBENCH_VERSION:
        raise ImportError(f"swebench {package.__version__} is installed; Canopy grades with {SWEBENCH_VERSION}")
    harness_dir = Path(spec.submodule_search_locations[0]) / "harness"
    if "swebench.harness" not in sys.modules:
        harness = types.ModuleType("swebench.harness")
        harness.__path__ = [str(harness_dir)]
        sys.modules["swebench.harness"] = harness
    modules = {
        name: importlib.import_module(f"swebench.{name}")
        for name in ("types", "harness.constants", "harness.grading", "harness.log_parsers", "harness.infra_failure")
    }
    return types.SimpleNamespace(
        TestSpec=modules["types"].TestSpec,
        constants=modules["harness.constants"],
        grading=modules["harness.grading"],
        parsers=modules["harness.log_parsers"].PARSER_REGISTRY,
        infra=modules["harness.infra_failure"],
        apply_commands=source_constant(harness_dir / "run_evaluation.py", "GIT_APPLY_CMDS"),
    )


def source_constant(path: Path, name: str):
    """A literal assigned at the top of a Python source file, read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise ImportError(f"{name} is no longer defined in {path}: the pinned package changed shape")


@dataclass(frozen=True)
class Grade:
    """`outcome` is resolved | unresolved | empty_patch | patch_apply_failed; `passed`/`total` count the
    instance's FAIL_TO_PASS and PASS_TO_PASS tests that passed (0 of them when the tests never ran)."""

    outcome: str
    passed: int
    total: int
    detail: str = ""
    tamper: str = ""  # "restored" | "rejected" when the patch changed what the tamper guard protects
    tampered: tuple[str, ...] = ()  # those paths (canopy.envs.swe_guard)


def test_spec(instance: dict):
    """swebench's `TestSpec` of an instance, as its `harness.utils.make_test_spec` builds it (that module imports
    datasets, so it is not imported here)."""
    sb = swebench()
    script = instance["eval_script"]
    lines = [line for line in script.strip().split("\n") if line not in ("#!/bin/bash", "set -uxo pipefail")]
    return sb.TestSpec(
        instance_id=instance["instance_id"],
        image=instance["image"],
        eval_script_list=lines,
        repo=instance["repo"],
        version=str(instance.get("version", "")),
        FAIL_TO_PASS=list(instance["FAIL_TO_PASS"]),
        PASS_TO_PASS=list(instance["PASS_TO_PASS"]),
        log_parser=instance["log_parser"],
        eval_type=instance.get("eval_type", "pass_and_fail"),
    )


def apply_patch(sandbox, patch: str, timeout: float) -> tuple[bool, str]:
    """swebench's apply chain in `sandbox`'s work tree; (applied, the last attempt's output)."""
    sandbox.run(f"cat > {PATCH_PATH}", timeout, stdin=patch.encode())
    output = ""
    for attempt, command in enumerate(swebench().apply_commands):
        if attempt:
            sandbox.run(RESET, timeout)
        result = sandbox.run(f"{command} {PATCH_PATH}", timeout)
        output = result.output
        if result.returncode == 0 and not result.timed_out:
            return True, output
    reverse = sandbox.run(f"git apply --check --reverse {PATCH_PATH}", timeout)  # already applied, all exits non-zero
    return reverse.returncode == 0, output


def run_tests(sandbox, instance: dict, timeout: float) -> tuple[str, bool]:
    """The instance's eval script in `sandbox`; (its log, whether it ran past `timeout`)."""
    sandbox.run(f"cat > {EVAL_PATH}", 60, stdin=instance["eval_script"].encode())
    result = sandbox.run(f"/bin/bash {EVAL_PATH}", timeout)
    return result.output, result.timed_out


class EvalLog:
    """An eval log, read once: its start and end markers, the text outside the test output, and the tests'
    statuses by the instance's swebench log parser. Scoring, the canary and fault attribution all use this one
    reading: a log that scoring read one way and the canary another (swebench reads after the first start marker)
    could be resolved by the one and clean for the other."""

    def __init__(self, text: str):
        c = swebench().constants
        self.text = text
        self.starts, self.ends = text.count(c.START_TEST_OUTPUT), text.count(c.END_TEST_OUTPUT)
        head, found, rest = text.partition(c.START_TEST_OUTPUT)
        self.outside = head + rest.partition(c.END_TEST_OUTPUT)[2] if found else text

    @property
    def duplicated(self) -> bool:
        """More than one start or end marker: the eval script prints each once, so the rest came from the tests'
        processes (an atexit hook, a daemon) or the patch's text."""
        return self.starts > 1 or self.ends > 1

    def statuses(self, instance: dict) -> tuple[dict[str, str], bool]:
        """(test name -> status, whether the log holds a test run), as swebench's `get_logs_eval` reads it."""
        with tempfile.NamedTemporaryFile("w", suffix=".log") as file:
            file.write(self.text)
            file.flush()
            return swebench().grading.get_logs_eval(test_spec(instance), file.name)

    def signature(self) -> str | None:
        """swebench's environment-tier infrastructure signature (daemon, OOM, DNS...) outside the test output, else
        None. Only a hint (`grade` confirms it with the gold patch): the patch controls what its tests print, and
        what the eval script prints around them too (an atexit hook writes after the end marker; git prints the
        patch's file names and text)."""
        found = swebench().infra.classify_text(self.outside)
        return found[0] if found and found[1] == swebench().infra.TIER_ENVIRONMENT else None


def test_status(instance: dict, log: str) -> dict[str, str]:
    """Test name -> status in an eval log, by the instance's swebench log parser."""
    return EvalLog(log).statuses(instance)[0]


def score(instance: dict, status: dict[str, str], found: bool) -> tuple[int, bool]:
    """(FAIL_TO_PASS and PASS_TO_PASS tests passed, resolved) from the tests' statuses, by swebench's report."""
    sb = swebench()
    spec = test_spec(instance)
    if not found:
        return 0, False
    tests = {sb.constants.FAIL_TO_PASS: spec.FAIL_TO_PASS, sb.constants.PASS_TO_PASS: spec.PASS_TO_PASS}
    report = sb.grading.get_eval_tests_report(status, tests, eval_type=sb.constants.EvalType(spec.eval_type))
    passed = sum(len(report[key]["success"]) for key in tests)
    return passed, sb.grading.get_resolution_status(report) == sb.constants.ResolvedStatus.FULL.value


def score_log(instance: dict, log: str) -> tuple[int, int, bool]:
    """(passed, total, resolved) from an eval log."""
    passed, resolved = score(instance, *EvalLog(log).statuses(instance))
    return passed, len(instance["FAIL_TO_PASS"]) + len(instance["PASS_TO_PASS"]), resolved


def grade(
    runtime, instance: dict, patch: str, timeout: float, command_timeout: float = 120, tamper: str = "restore"
) -> Grade:
    """Grade `patch` for `instance` in a fresh sandbox of its image (the agent's side effects cannot leak in).
    `tamper` (canopy.envs.swe_guard): `restore` puts back what the patch changed of how its tests run, `reject`
    scores such a patch unresolved untested, `off` grades as upstream swebench does.

    A grading is the serving layer's fault (`EnvironmentFault`, quarantined) only on evidence the patch cannot
    produce: its sandbox failed (the runtime says so), or an infrastructure signature in its log is found again when
    the task's gold patch is graded right after in a fresh sandbox. Otherwise the signature is the patch's own (its
    code can print anything, anywhere in the log) and the grade stands."""
    graded, signature = grade_once(runtime, instance, patch, timeout, command_timeout, tamper)
    if signature is None:
        return graded
    found = f"swebench signature {signature} in the eval log"
    if not instance.get("patch"):
        unconfirmed = f"{found}, unconfirmed (the instance has no gold patch): graded as it stands"
        return replace(graded, detail="; ".join(filter(None, (graded.detail, unconfirmed))))
    control, again = grade_once(runtime, instance, instance["patch"], timeout, command_timeout, tamper)
    if again is not None or control.outcome != "resolved":
        why = f"signature {again}" if again is not None else control.outcome
        raise EnvironmentFault(
            "grading_infra_failure",
            f"{instance['instance_id']}: {found}, and the gold patch graded in a fresh sandbox right after failed "
            f"too ({why})",
        )
    own = f"{found} is the patch's own: the gold patch graded in a fresh sandbox has none"
    return replace(graded, detail="; ".join(filter(None, (graded.detail, own))))


def grade_once(
    runtime, instance: dict, patch: str, timeout: float, command_timeout: float, tamper: str
) -> tuple[Grade, str | None]:
    """One grading (see `grade`): the grade, and the log's infrastructure signature where the grade could be the
    serving layer's (None for a patch that tampered with its test run: that log is the patch's)."""
    total = len(instance["FAIL_TO_PASS"]) + len(instance["PASS_TO_PASS"])
    if not patch.strip():
        return Grade("empty_patch", 0, total), None
    try:
        sandbox = runtime.start(instance["image"])
    except SandboxError as error:
        raise EnvironmentFault("grading_sandbox_failed", str(error)) from None
    try:
        guard = TamperGuard(sandbox, instance, command_timeout) if tamper != "off" else None
        canary = plant(sandbox, instance, command_timeout) if guard is not None else None
        applied, output = apply_patch(sandbox, patch, command_timeout)
        if not applied:
            return Grade("patch_apply_failed", 0, total, output.strip()[-300:]), None
        tampered = tuple(guard.changed()) if guard is not None else ()
        if tampered and (tamper == "reject" or not guard.restore(list(tampered))):
            detail = "the patch changes how its tests run" + ("" if tamper == "reject" else " beyond restoring")
            return Grade("unresolved", 0, total, detail, "rejected", tampered), None
        planted = {**instance, "eval_script": canary.eval_script} if canary is not None else instance
        text, timed_out = run_tests(sandbox, planted, timeout)
    except SandboxError as error:
        raise EnvironmentFault("grading_sandbox_failed", str(error)) from None
    finally:
        sandbox.close()
    log = EvalLog(text)
    restored = ("restored", tampered) if tampered else ()
    if guard is not None and log.duplicated:
        detail = f"the eval log holds {log.starts} start and {log.ends} end markers: the test run was tampered with"
        return Grade("unresolved", 0, total, detail, "rejected", (*tampered, "(test log)")), None
    if timed_out:  # as swebench's harness, whose timed-out log parses as no tests run
        return Grade("unresolved", 0, total, f"tests ran past {timeout:.0f} s", *restored), log.signature()
    status, found = log.statuses(instance)
    passed, resolved = score(instance, status, found)
    if canary is not None:
        reported = canary.reported(status)
        failed = swebench().constants.TestStatus.FAILED.value
        if swebench().constants.TestStatus.PASSED.value in reported or (resolved and set(reported) != {failed}):
            detail = f"planted failing tests were reported {reported}, not all failed: the test run was tampered with"
            return Grade("unresolved", 0, total, detail, "rejected", (*tampered, "(test run)")), None
    return Grade("resolved" if resolved else "unresolved", passed, total, "", *restored), log.signature()
