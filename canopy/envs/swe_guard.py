"""The tamper guard of SWE-bench grading: what the submitted patch may not change about how its tests run.

swebench's eval script resets only the test patch's own files, so a patch that adds a `conftest.py` whose hook
marks every report passed is graded resolved, upstream included. In RL that is a reward a policy can find. Before
the eval script runs, everything below that the patch changed is put back as it was at `base_commit` (a file the
patch created is removed), and the result is verified against the snapshot taken before the patch was applied.

What is guarded, and why (how each runner finds its configuration):
- pytest reads its configuration from the first of `pytest.toml`, `.pytest.toml` (9.0), `pytest.ini`,
  `.pytest.ini`, `pyproject.toml` (`[tool.pytest]`, `[tool.pytest.ini_options]`), `tox.ini` (`[pytest]`) and
  `setup.cfg` (`[tool:pytest]`) in the common ancestor of its arguments and that folder's parents
  (`_pytest.config.findpaths.locate_config`): a new one in any test folder takes over, so these names are guarded
  at any depth. Its `addopts` reach every option (`-p plugin`, `-k`, `--deselect`, `-p no:...`).
- `conftest.py` is loaded from the rootdir down to every collected folder: hooks, fixtures and `pytest_plugins`.
- Plugins load from `-p` (configuration, above), `pytest_plugins` (conftest, above) and the `pytest11` entry points
  of every distribution `importlib.metadata` finds on `sys.path`, which with `python -m pytest` or an editable
  install includes the repository: `*.dist-info` and `*.egg-info` folders are guarded at any depth.
- The interpreter runs `sitecustomize.py` / `usercustomize.py` from `sys.path` at every start (an editable install
  puts the repository there first) and the lines of `*.pth` files in site folders: guarded at any depth. So is
  `*.pyc`: an unchecked-hash pyc is imported in place of its source (PEP 552), and no patch carries one honestly.
- Python imports a module from the first folder on `sys.path` that has it: the repository under `python -m` or an
  editable install, and a test's first folder without `__init__.py` under pytest's prepend import mode. A module
  the patch creates there (or in `src/`) under the name of a standard-library module or of the runner (`pytest.py`,
  `pprint.py`, `pytest_*`) replaces the real one: new ones are guarded, the repository's own are its code.
- unittest, Django's runner and pytest (prepend import mode) import the `__init__.py` of test packages before the
  tests (unittest's `load_tests` lives there): `__init__.py` of every test-named folder (test, tests, testing,
  test_*, *_tests) above the test patch's files.
- The runner the eval script names: repository files among its commands' words (Django's `tests/runtests.py`,
  sympy's `bin/test`, a `Makefile` for `make`, a file after `-c`), and Django's `--settings` module beside it;
  tox reads `tox.ini`, `tox.toml`, `[tox:tox]`/`[testenv]` of `setup.cfg` and `[tool.tox]` of `pyproject.toml`;
  nose reads `[nosetests]` of `setup.cfg`; `python setup.py test` reads its `[aliases]`.
- The test patch's own files, where the patch created them (upstream's `git checkout` cannot reset a file the
  base lacks, so the test patch then fails to apply and the patch's version runs), and every folder above them
  (a folder replaced by a symlink redirects the checkout and the test run).
- `.git` (but its objects and index, which `git apply --3way` writes): the eval script runs `git checkout` and `git
  apply`, which run hooks (`post-checkout`) and read `config` and `info/`; `patch`, last in the apply chain, writes
  there when asked.
`pyproject.toml`, `setup.cfg` and `tox.ini` also hold what an honest fix may change (dependencies, versions, lint
settings): one is restored whole only when a test-runner section above differs from the base's.

The code under test itself runs inside the test process, out of a file guard's reach: a patch to the package can
rewrite pytest's reports from its own import. For that, pytest-parsed instances get a canary among their tests
(`canopy.envs.swe_canary`).
"""

import configparser
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import PurePosixPath

from canopy.envs.base import EnvironmentFault
from canopy.envs.isolation import SandboxError

POLICIES = ("restore", "reject", "off")
GUARD = "/tmp/canopy-guard"
ANY_DEPTH = (
    "conftest.py", "pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini",
    "tox.toml", "setup.cfg", "sitecustomize.py", "usercustomize.py", "*.pth", "*.pyc", "*.dist-info", "*.egg-info",
)  # fmt: skip
RUNNER_SECTIONS = {  # per shared file: the tables / sections a test runner reads (prefixes for ini sections)
    "pyproject.toml": ("tool.pytest", "tool.tox", "project.entry-points.pytest11"),
    "setup.cfg": ("tool:pytest", "pytest", "nosetests", "tox:tox", "testenv", "aliases", "options.entry_points"),
    "tox.ini": ("pytest", "tox", "testenv"),
}
TEST_FOLDER = re.compile(r"^(tests?|testing|tests?_.+|.+_tests?)$")
TEST_PATCH_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
HEREDOC = re.compile(r"(?<!<)<<-?\s*['\"]?(\w+)")  # a here-document (not a here-string, <<<)

# One record per guarded path, NUL-terminated: `path \001 type [size mtime | link target]`. Folders record their
# type only (their size and time change with their entries); `find` does not follow symlinks.
FORMAT = r"\( -type d -printf '%p\001d\0' \) -o \( -type l -printf '%p\001l %l\0' \) -o -printf '%p\001%y %s %T@\0'"
NAMES = " -o ".join(f"-name '{name}'" for name in ANY_DEPTH) + " -o -path '*.dist-info/*' -o -path '*.egg-info/*'"
SHADOWABLE = sorted(sys.stdlib_module_names | {"pytest", "_pytest", "pluggy", "py", "iniconfig", "nose", "nose2"})
MODULE_FILE = r"(\.py|\.pyc|/__init__\.py|(\.[^/]*)?\.so)"


def shadowing(folders: tuple[str, ...]) -> str:
    """A regex of the modules that would shadow the standard library or the test runner from the folders Python
    searches first: the repository (`python -m`, an editable install), `src/`, and test-named folders above the
    test files (pytest's prepend import mode puts a test's first folder without `__init__.py` first on sys.path;
    a package folder above a test is not searched, and new modules there are the fix's own)."""
    tests = [folder for folder in folders if TEST_FOLDER.match(PurePosixPath(folder).name)]
    roots = "|".join(re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", folder) for folder in ("src", *tests))
    names = "|".join(SHADOWABLE)
    return rf"\./(({roots})/)?({names}|pytest_[^/]*){MODULE_FILE}"


def record_script(scope: "Scope") -> str:
    """Bash defining `record`: the guarded paths' records, sorted (see FORMAT)."""
    return (
        "export LC_ALL=C; record() { { find . \\( -path './.git/objects/??' -o -path ./.git/objects/pack "
        f"-o -path ./.git/index \\) -prune -o \\( {NAMES} -o -path './.git/*' -o -regextype posix-extended -regex "
        f"{shlex.quote(shadowing(scope.folders))} \\) \\( {FORMAT} \\); "
        f"xargs -0 -r -I{{}} find {{}} -maxdepth 0 \\( {FORMAT} \\) < {GUARD}/explicit 2>/dev/null; }} "
        "| sort -zu; }; "
    )


DIFFERENCE = f"cd /testbed && LC_ALL=C comm -z -3 {GUARD}/before {GUARD}/%s"  # only before; only now (tab first)


@dataclass(frozen=True)
class Scope:
    """The instance-specific guarded paths (relative to /testbed): the test patch's files, the folders above them,
    and the runner's files and test-package `__init__.py` files."""

    test_files: tuple[str, ...]
    folders: tuple[str, ...]
    runner: tuple[str, ...]

    @property
    def explicit(self) -> tuple[str, ...]:
        return self.test_files + self.folders + self.runner


def scope(instance: dict) -> Scope:
    """What the guard protects for `instance` besides the names it guards everywhere."""
    test_files = sorted({path for pair in TEST_PATCH_FILE.findall(instance["test_patch"]) for path in pair})
    folders = sorted({str(parent) for path in test_files for parent in PurePosixPath(path).parents} - {"."})
    inits = [f"{folder}/__init__.py" for folder in folders if TEST_FOLDER.match(PurePosixPath(folder).name)]
    runner = sorted(set(runner_files(instance["eval_script"])) - set(test_files))
    return Scope(tuple(test_files), tuple(folders), tuple(sorted(set(inits) | set(runner))))


def runner_files(script: str) -> list[str]:
    """Repository files named by the eval script's commands (not its git lines, not the test patch's heredoc)."""
    files, settings, heredoc = [], [], None
    for line in script.splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        found = HEREDOC.search(line)
        heredoc = found.group(1) if found else None
        if line.lstrip().startswith(("git ", "#", ":")):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        for before, word in zip([""] + words, words):
            path = word.removeprefix("/testbed/").removeprefix("./")
            if word == "make":
                files.append("Makefile")
            elif word.startswith("--settings="):
                settings.append(word.split("=", 1)[1].replace(".", "/") + ".py")
            elif path and not path.startswith(("-", "/", "$")) and "=" not in path and ".." not in path:
                if "/" in path or path.endswith((".py", ".sh", ".cfg", ".ini", ".toml")) or before == "-c":
                    files.append(path)
    runners = [f for f in files if f.endswith(".py")]  # Django's settings module is found beside its runner
    return files + [str(PurePosixPath(runner).parent / module) for runner in runners for module in settings]


def runner_sections(name: str, text: str | None) -> dict | None:
    """The test-runner sections of a shared configuration file (RUNNER_SECTIONS; `text` None: the file is absent),
    or None if it cannot be parsed."""
    text = text or ""
    prefixes = RUNNER_SECTIONS[name]
    try:
        if name.endswith(".toml"):
            data, found = tomllib.loads(text), {}
            for dotted in prefixes:
                value = data
                for key in dotted.split("."):
                    value = value.get(key) if isinstance(value, dict) else None
                found[dotted] = value
            return found
        parser = configparser.ConfigParser(interpolation=None, strict=False, default_section="\0")
        parser.optionxform = str
        parser.read_string(text)
        return {s: dict(parser[s]) for s in parser.sections() if s.split(":")[0] in prefixes or s in prefixes}
    except (tomllib.TOMLDecodeError, configparser.Error, UnicodeError):
        return None


def run_checked(sandbox, command: str, timeout: float, stdin: bytes | None, who: str, needs: str) -> str:
    """A grading helper's command in the grading sandbox; its failure is the serving layer's, naming what the image
    must hold and the way to grade without the helper."""
    try:
        result = sandbox.run(command, timeout, stdin=stdin)
    except SandboxError as error:
        raise EnvironmentFault("grading_sandbox_failed", str(error)) from None
    if result.returncode != 0 or result.timed_out:
        raise EnvironmentFault(
            "grading_sandbox_failed",
            f"{who}: {result.output.strip()[-300:]} (it needs {needs} in the image; env.swebench.tamper=off grades "
            f"without it)",
        )
    return result.output


class TamperGuard:
    """Snapshot the guarded paths of a fresh grading sandbox, then find, restore and verify what a patch changed."""

    def __init__(self, sandbox, instance: dict, timeout: float):
        self.sandbox, self.instance, self.timeout = sandbox, instance, timeout
        self.scope = scope(instance)
        self.record, self.shadowing = record_script(self.scope), re.compile(shadowing(self.scope.folders))
        explicit = "".join(f"./{path}\0" for path in self.scope.explicit).encode()
        self._run(f"rm -rf {GUARD} && mkdir -p {GUARD} && cat > {GUARD}/explicit", stdin=explicit)
        self._run(
            f"{self.record} cd /testbed && record > {GUARD}/before && sed -z 's/\\x01.*//' {GUARD}/before | "
            f"tar --format=posix --null --no-recursion -T - -cf {GUARD}/backup.tar 2>/dev/null; true"
        )
        self.allowed: set[str] = set()

    def _run(self, command: str, stdin: bytes | None = None) -> str:
        return run_checked(
            self.sandbox, command, self.timeout, stdin, "tamper guard", "bash, GNU find, sort, comm, sed and tar"
        )

    def changed(self) -> list[str]:
        """The guarded paths the patch changed (relative to /testbed), less those it may change: the test patch's
        files the base has (the eval script resets them itself), the repository's own modules under a shadowing
        name, and shared files whose test-runner sections are unchanged."""
        self._run(f"{self.record} cd /testbed && record > {GUARD}/after")
        base, paths = self._difference("after")
        reset = {f"./{path}" for path in self.scope.test_files} & base
        own_modules = {p for p in paths & base if self.shadowing.fullmatch(p)}  # the repository's, not new ones
        self.allowed = reset | own_modules | {p for p in paths if self._runner_sections_unchanged(p, p in base)}
        return sorted(p.removeprefix("./") for p in paths if p not in self.allowed)

    def _difference(self, name: str) -> tuple[set[str], set[str]]:
        """(the paths of the records only the snapshot has, the paths of all records that differ) against `name`."""
        records = [r for r in self._run(DIFFERENCE % name).split("\0") if r]
        base = {r.partition("\x01")[0] for r in records if not r.startswith("\t")}
        return base, base | {r[1:].partition("\x01")[0] for r in records if r.startswith("\t")}

    def _runner_sections_unchanged(self, path: str, in_base: bool) -> bool:
        name = PurePosixPath(path).name
        if name not in RUNNER_SECTIONS or not re.fullmatch(r"[\w./-]+", path):
            return False
        before = self._text(f"tar -xOf {GUARD}/backup.tar -- {path}") if in_base else None
        sections = runner_sections(name, before), runner_sections(name, self._text(f"cat -- {path}"))
        return None not in sections and sections[0] == sections[1]

    def _text(self, command: str) -> str | None:
        """A command's output, None if it failed (the file is absent)."""
        try:
            result = self.sandbox.run(f"cd /testbed && {command}", self.timeout)
        except SandboxError as error:
            raise EnvironmentFault("grading_sandbox_failed", str(error)) from None
        return result.output if result.returncode == 0 and not result.timed_out else None

    def restore(self, paths: list[str]) -> bool:
        """Put `paths` back as the base had them (remove what it lacked), then verify: True when every guarded path
        unlike the snapshot is one the patch may change."""
        listed = "".join(f"./{path}\0" for path in paths).encode()
        folders = [folder for folder in self.scope.folders if folder in paths]  # replaced by a file or a symlink
        checkout = f"git checkout -q {self.instance['base_commit']} -- {shlex.join(folders)}; " if folders else ""
        self._run(
            f"cat > {GUARD}/restore && cd /testbed && xargs -0 -r rm -rf -- < {GUARD}/restore; {checkout}"
            f"tar --null -T {GUARD}/restore -xf {GUARD}/backup.tar 2>/dev/null; true",
            stdin=listed,
        )
        self._run(f"{self.record} cd /testbed && record > {GUARD}/final")
        return self._difference("final")[1] <= self.allowed
