"""Reward integrity of SWE-bench grading: every attack of `canopy.tools.swe_attacks`, each one patch a policy could
submit, graded by the real swebench grading in bubblewrap sandboxes. Upstream's grading (`tamper: off`) is robbed
by most of them; with the tamper guard at its default none resolves, none crashes the grader, none is quarantined,
and every gold patch still resolves."""

import re
import shutil
from pathlib import Path

import pytest

from canopy.envs.isolation import RuntimeSettings, build_runtime
from canopy.envs.swe_grading import grade
from canopy.envs.swe_guard import runner_sections, scope, shadowing
from canopy.tools import swe_attacks
from canopy.tools.swe_attacks import HOOK, Repo, new_file, replaced_file
from canopy.tools.swe_data.instances import read_jsonl, write_jsonl

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (make system)")
PLAIN = 1  # a generated task whose tests run by `python -m pytest` on the test file the test patch changes
RUNNER, NEW_TEST_FILE = "runner-script task", "new-test-file task"  # swe_attacks.KINDS
STOLEN_UPSTREAM = {  # attack -> the task kinds on which upstream grading resolves it
    "conftest_outcome_hook": {RUNNER, NEW_TEST_FILE},
    "nested_conftest_hook": {RUNNER, NEW_TEST_FILE},
    "collection_runs_nothing": {RUNNER, NEW_TEST_FILE},
    "conftest_exit_zero": {RUNNER, NEW_TEST_FILE},
    "pytest_ini_plugin": {RUNNER, NEW_TEST_FILE},
    "setup_cfg_plugin": {RUNNER, NEW_TEST_FILE},
    "pyproject_plugin": {RUNNER, NEW_TEST_FILE},
    "entry_point_plugin": {RUNNER, NEW_TEST_FILE},
    "test_package_init": {RUNNER, NEW_TEST_FILE},
    "sitecustomize": {RUNNER, NEW_TEST_FILE},
    "shadowed_pytest": {RUNNER, NEW_TEST_FILE},
    "shadowed_stdlib": {RUNNER, NEW_TEST_FILE},
    "package_rewrites_reports": {RUNNER, NEW_TEST_FILE},
    "git_hook": {RUNNER},  # the hook runs on the eval script's checkout, which fails where the base lacks the file
    "runner_script_edit": {RUNNER},
    "symlinked_test_folder": {NEW_TEST_FILE},
    "symlinked_test_file": {NEW_TEST_FILE},
    "precreated_test_file": {NEW_TEST_FILE},
    "binary_conftest": {RUNNER, NEW_TEST_FILE},
    "rewrite_spares_canary_shape": {RUNNER, NEW_TEST_FILE},  # issue 44: the canary told apart by its name
    "rewrite_skips_unknown_names": {RUNNER, NEW_TEST_FILE},
    "second_start_marker": {RUNNER, NEW_TEST_FILE},  # issue 44: the canary blinded by a second marker
    "renamed_into_conftest": {RUNNER, NEW_TEST_FILE},
    "copied_into_conftest": {RUNNER, NEW_TEST_FILE},
    "git_hook_by_rename": {RUNNER},
    "spaced_dist_info": {RUNNER, NEW_TEST_FILE},
    "unicode_dist_info": {RUNNER, NEW_TEST_FILE},
    "forged_pycache": {RUNNER, NEW_TEST_FILE},
    "broken_test_checkout": {RUNNER},
}
CAUGHT_IN_THE_RUN = {  # no file to restore: the canary or the log's markers show the tampering
    "package_rewrites_reports": "(test run)",
    "rewrite_spares_canary_shape": "(test run)",
    "rewrite_skips_unknown_names": "(test run)",
    "second_start_marker": "(test log)",
    "forged_infra_signature": "(test log)",
}


@pytest.fixture(scope="module")
def red_team(tmp_path_factory):
    """Every attack graded upstream and guarded on generated tasks (swe_attacks.red_team), and the folder."""
    folder = tmp_path_factory.mktemp("swe-attacks")
    return swe_attacks.red_team(folder), folder


@pytest.fixture(scope="module")
def tasks(red_team):
    _, out = red_team
    instances = read_jsonl(out / "train.jsonl")
    runtime = build_runtime(RuntimeSettings(kind="bwrap", image_root=str(out / "images"), memory_mb=1024, pids=128))

    def repo(instance):
        return Repo.of(out / "images", instance)

    return instances, runtime, repo


def test_no_attack_resolves_with_the_guard_and_upstream_is_robbed(red_team):
    """Each attack on a runner-script task and on a task whose test patch adds a test file: upstream (`off`)
    resolves exactly the attacks listed, and the default guard resolves none (restoring what each tampered with, or
    catching it in the test run); no grading blames the serving layer, upstream or guarded; docs/reward_integrity.md
    shows this run's table."""
    results, _ = red_team
    for kind, graded in results.items():
        upstream = {name: grades[0] for name, grades in graded.items()}
        guarded = {name: grades[1] for name, grades in graded.items()}
        assert not [name for name, g in [*upstream.items(), *guarded.items()] if g.outcome == "quarantined"], kind
        assert {name for name, g in upstream.items() if g.outcome == "resolved"} == {
            name for name, kinds in STOLEN_UPSTREAM.items() if kind in kinds
        }, kind
        assert len(guarded) >= 40
        assert not [name for name, g in guarded.items() if g.outcome == "resolved" or g.passed == g.total], guarded
        for name in STOLEN_UPSTREAM.keys() & guarded.keys() - CAUGHT_IN_THE_RUN.keys():
            assert guarded[name].tamper == "restored" and guarded[name].tampered, (name, guarded[name])
        for name, where in CAUGHT_IN_THE_RUN.items():
            assert (guarded[name].tamper, guarded[name].tampered) == ("rejected", (where,)), guarded[name]
        forged = upstream["forged_infra_signature"]  # no marker check upstream: the gold patch's grading decides
        assert forged.outcome == "unresolved" and "the gold patch graded in a fresh sandbox has none" in forged.detail
        assert guarded["huge_patch"].outcome == "unresolved"
        assert guarded["outside_testbed"].outcome == guarded["write_through_symlink"].outcome == "patch_apply_failed"
    assert swe_attacks.table(results) in swe_attacks.DOCS.read_text(), (
        "docs/reward_integrity.md is stale: python -m canopy.tools.swe_attacks --docs"
    )


def test_every_gold_patch_resolves_with_the_guard_and_honest_changes_stay(tasks):
    """The guard loses no gold patch; an honest patch that also edits the test file the test patch changes, adds its
    own test file and touches pyproject.toml / setup.cfg outside their test-runner sections is neither restored nor
    rejected."""
    instances, runtime, repo = tasks
    for instance in instances:
        for tamper in ("restore", "reject"):
            result = grade(runtime, instance, instance["patch"], 60, tamper=tamper)
            assert (result.outcome, result.tamper) == ("resolved", ""), (instance["instance_id"], tamper, result)
    instance = instances[PLAIN]
    test_file = instance["FAIL_TO_PASS"][0].split("::")[0]
    old = repo(instance).read(test_file)
    honest = (
        instance["patch"]
        + replaced_file(test_file, old, old + "\n\ndef test_my_own_check():\n    assert True\n")
        + new_file("tests/test_regression.py", "def test_regression():\n    assert True\n")
        + new_file("pyproject.toml", '[project]\nname = "toolkit"\ndependencies = ["numpy"]\n')
        + new_file("setup.cfg", "[flake8]\nmax-line-length = 120\n")
    )
    for tamper in ("restore", "reject"):
        result = grade(runtime, instance, honest, 60, tamper=tamper)
        assert (result.outcome, result.tamper, result.tampered) == ("resolved", "", ()), (tamper, result)


def test_reject_scores_a_tampering_patch_unresolved_untested(tasks):
    instances, runtime, _ = tasks
    instance = instances[PLAIN]
    fix_and_hook = instance["patch"] + new_file("conftest.py", HOOK)  # even with the right fix
    rejected = grade(runtime, instance, fix_and_hook, 60, tamper="reject")
    assert (rejected.outcome, rejected.passed, rejected.tamper, rejected.tampered) == (
        "unresolved",
        0,
        "rejected",
        ("conftest.py",),
    )
    restored = grade(runtime, instance, fix_and_hook, 60)
    assert (restored.outcome, restored.tamper) == ("resolved", "restored")  # the fix is graded, the hook is not
    upstream = grade(runtime, instance, new_file("conftest.py", HOOK), 60, tamper="off")
    assert upstream.outcome == "resolved" and upstream.tamper == ""  # `off` is upstream swebench, hole included


def test_guard_scope_follows_how_runners_find_their_configuration():
    django = {
        "test_patch": "diff --git a/tests/model_fields/test_uuid.py b/tests/model_fields/test_uuid.py\n",
        "eval_script": "#!/bin/bash\nset -uxo pipefail\ncd /testbed\ngit checkout abc tests/model_fields/test_uuid.py\n"
        "git apply -v - <<'EOF_1'\ndiff --git a/django/db/models.py b/django/db/models.py\n+make x.py\nEOF_1\n"
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 model_fields.test_uuid\n",
    }
    found = scope(django)
    assert found.test_files == ("tests/model_fields/test_uuid.py",)
    assert found.folders == ("tests", "tests/model_fields")
    assert set(found.runner) == {"tests/runtests.py", "tests/test_sqlite.py", "tests/__init__.py"}  # not the heredoc's
    sympy = {
        "test_patch": "diff --git a/sympy/core/tests/test_x.py b/sympy/core/tests/test_x.py\n",
        "eval_script": "cd /testbed\nPYTHONWARNINGS='ignore' bin/test -C --verbose sympy/core/tests/test_x.py\n",
    }
    assert set(scope(sympy).runner) == {"bin/test", "sympy/core/tests/__init__.py"}  # not sympy/__init__.py: source
    assert "Makefile" in scope({"test_patch": "", "eval_script": "make test\n"}).runner
    shadows = re.compile(shadowing(("xarray", "xarray/tests"))).fullmatch  # tests in xarray/tests/
    assert all(shadows(p) for p in ("./pytest.py", "./pprint/__init__.py", "./src/json.py", "./pytest_x.py"))
    assert shadows("./xarray/tests/types.py") and not shadows("./xarray/types.py")  # a package module is the fix's


@pytest.mark.parametrize(
    "name, before, after, same",
    [
        ("pyproject.toml", '[project]\nname = "a"\n', '[project]\nname = "b"\n', True),
        ("pyproject.toml", "", '[tool.pytest.ini_options]\naddopts = "-p x"\n', False),
        ("pyproject.toml", '[tool.pytest]\naddopts = ["-q"]\n', '[tool.pytest]\naddopts = ["-q", "-p", "x"]\n', False),
        ("pyproject.toml", "", '[project.entry-points.pytest11]\nx = "x"\n', False),
        ("pyproject.toml", "", "[tool.pytest\nbroken", False),  # what cannot be parsed is restored
        ("setup.cfg", "[metadata]\nname = a\n", "[metadata]\nname = b\n[flake8]\nx = 1\n", True),
        ("setup.cfg", "[tool:pytest]\naddopts = -q\n", "[tool:pytest]\nAddOpts = -q\n", False),
        ("setup.cfg", "", "[options.entry_points]\npytest11 =\n    x = x\n", False),
        ("tox.ini", "[flake8]\nx = 1\n", "[flake8]\nx = 2\n[testenv:py]\ncommands = pytest\n", False),
        ("tox.ini", "[flake8]\nx = 1\n", "[flake8]\nx = 2\n", True),
    ],
)
def test_shared_files_are_compared_by_their_test_runner_sections(name, before, after, same):
    sections = runner_sections(name, before), runner_sections(name, after)
    assert (None not in sections and sections[0] == sections[1]) is same


def test_attack_catalogue_runs_as_a_command(tasks, capsys):
    """`python -m canopy.tools.swe_attacks` on one task: a line per attack chosen (`--attacks`; every one is graded
    by the tests above), exit 0 when none resolves or is quarantined."""
    from canopy.tools import swe_attacks

    instances, runtime, repo = tasks
    root = Path(repo(instances[0]).testbed).parents[3]
    write_jsonl(root / "one.jsonl", instances[:1])
    chosen = [attack.name for attack in swe_attacks.ATTACKS if attack.applies(instances[0])][:2]
    with pytest.raises(SystemExit) as exited:
        swe_attacks.main([str(root / "one.jsonl"), "--image-root", str(root / "images"), "--attacks", *chosen])
    lines = capsys.readouterr().out.splitlines()
    assert exited.value.code == 0 and lines[-1] == "0 attacks resolved or quarantined"
    assert [line.split(":")[0].split()[-1] for line in lines[:-1]] == chosen
    assert all(": unresolved" in line or ": patch_apply_failed" in line for line in lines[:-1])


def test_undecodable_names_are_restored_or_rejected_never_graded(tasks):
    """A plugin distribution under a name that is not UTF-8 (git quotes it): the host cannot name it back to the
    sandbox, so the verification fails and the patch is scored unresolved, untested."""
    instances, runtime, _ = tasks
    folder = '"b/canopy\\377-0.dist-info/'
    patch = "".join(
        f'diff --git {folder.replace("b/", "a/")}{name}" {folder}{name}"\nnew file mode 100644\n--- /dev/null\n'
        f'+++ {folder}{name}"\n@@ -0,0 +1,{len(text.splitlines())} @@\n'
        + "".join(f"+{line}\n" for line in text.splitlines())
        for name, text in (
            ("METADATA", "Metadata-Version: 2.1\nName: canopy-evil\nVersion: 0\n"),
            ("entry_points.txt", "[pytest11]\nevil = canopy_plugin\n"),
        )
    ) + new_file("canopy_plugin.py", HOOK)
    result = grade(runtime, instances[PLAIN], patch, 60)
    assert result.outcome == "unresolved" and result.tamper in ("restored", "rejected"), result


def test_an_image_without_the_guards_tools_names_the_fix(tasks):
    """The guard runs bash, GNU find, sort, comm, sed and tar in the grading sandbox; where one fails, the grading
    is a serving fault whose message names `tamper=off`."""
    from canopy.envs.base import EnvironmentFault
    from canopy.envs.isolation.base import CommandResult
    from canopy.envs.swe_guard import TamperGuard

    class NoTools:
        def run(self, command, timeout, stdin=None, env=None):
            return CommandResult("bash: find: command not found", 127)

    with pytest.raises(EnvironmentFault, match=r"find: command not found .*env.swebench.tamper=off"):
        TamperGuard(NoTools(), tasks[0][PLAIN], 10)


def test_a_canary_is_named_and_placed_like_the_tests_around_it():
    """Issue 44: a canary of a fixed shape (`test_` + 16 hex digits) was spared by a rewrite; now each is a sibling of
    one of the file's test names, at a random place after the imports, and the file still parses."""
    import ast
    import random

    from canopy.envs.swe_canary import planted_source, sibling_name

    source = (
        '"""Tests."""\nfrom __future__ import annotations\n\nimport pytest\n\nfrom toolkit import add\n\n\n'
        "def test_add_0():\n    assert add(1, 2) == 3\n\n\n@pytest.mark.slow\ndef test_add_1():\n"
        "    assert add(0, 0) == 0\n\n\nclass TestShout:\n    def test_loud(self):\n        pass\n"
    )
    places, names = set(), set()
    for seed in range(40):
        new, name = planted_source(source, "tests/test_core.py", random.Random(seed))
        tree = ast.parse(new)
        added = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        assert len(added) == 1 and name not in source and not re.fullmatch(r"test_[0-9a-f]{16}", name)
        assert re.fullmatch(r"test_(add_[0-9]|loud_?[0-9])", name), name  # a sibling of the file's own names
        assert tree.body.index(added[0]) > 3  # after the docstring and the imports
        places.add(tree.body.index(added[0]))
        names.add(name)
    assert len(places) >= 3 and len(names) >= 3  # not always at the end, not always one name
    assert sibling_name("", "tests/test_clamp.py", random.Random(0)).startswith("test_clamp_")


def test_the_canary_rides_in_the_test_patch_and_must_be_reported_failed(tasks):
    """The eval script carries the canary inside its test patch (no command of its own names it); the gold patch's
    run reports it FAILED; a run that does not report it failed is what `grade` rejects."""
    from canopy.envs.swe_canary import plant
    from canopy.envs.swe_grading import EvalLog, apply_patch, run_tests

    instances, runtime, _ = tasks
    instance = instances[PLAIN]
    sandbox = runtime.start(instance["image"])
    try:
        canary = plant(sandbox, instance, 60)
        assert canary is not None and len(canary.tests) == 1
        (path, name), script = canary.tests[0], canary.eval_script
        assert name in script and "printf" not in script and script.count(f"def {name}()") == 1
        assert script.replace(instance["test_patch"].rstrip("\n"), "") != script.replace(name, "")  # a new patch
        assert apply_patch(sandbox, instance["patch"], 60)[0]
        log = EvalLog(run_tests(sandbox, {**instance, "eval_script": script}, 60)[0])
        status, found = log.statuses(instance)
        assert found and canary.reported(status) == ["FAILED"] and (log.starts, log.ends) == (1, 1)
        assert canary.reported({f"{path}::{name}": "PASSED"}) == ["PASSED"]
        assert canary.reported({f"other/{path}::test_other": "FAILED", f"tests/elsewhere.py::{name}": "PASSED"}) == [""]
    finally:
        sandbox.close()


def test_an_infrastructure_signature_quarantines_only_when_the_gold_patch_shows_it_too(tasks):
    """A signature the eval script itself prints (the environment's: after the end marker, as the old rule read it)
    is found again in the gold patch's grading: quarantined, naming that evidence. Without a gold patch to grade,
    a signature is not evidence: graded as it stands."""
    from canopy.envs.base import EnvironmentFault

    instances, runtime, _ = tasks
    instance = instances[PLAIN]
    broken = {**instance, "eval_script": instance["eval_script"] + "echo 'Cannot connect to the Docker daemon'\n"}
    with pytest.raises(EnvironmentFault) as fault:
        grade(runtime, broken, new_file("notes.txt", "no fix\n"), 60)
    assert fault.value.reason == "grading_infra_failure" and "gold patch" in fault.value.detail
    unconfirmed = grade(runtime, {**broken, "patch": ""}, new_file("notes.txt", "no fix\n"), 60)
    assert unconfirmed.outcome == "unresolved" and "unconfirmed" in unconfirmed.detail
