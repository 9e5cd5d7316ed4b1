"""The attribution rule (issue 44, canopy.envs.attribution): every quarantine reason the code can raise names its
evidence, and docs/environments.md shows that table; the full-scratch probe tells another tenant's full disk from
the policy's own."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from canopy.envs.attribution import QUARANTINE_EVIDENCE, evidence_table, full_scratch, usage
from canopy.envs.fault_injection import fill

ROOT = Path(__file__).resolve().parents[1]
RAISED = re.compile(
    r"(?:EnvironmentFault|\b_?fault)\(\s*\"(\w+)\"|\(\"fault\", \"(\w+)\"|return \"(worker_\w+)\", |Fault\(\"(\w+)\"\)"
)


def raised_reasons() -> set[str]:
    found = set()
    for path in (ROOT / "canopy").rglob("*.py"):
        for match in RAISED.finditer(path.read_text()):
            found.add(next(group for group in match.groups() if group))
    return found


def test_every_quarantine_reason_names_its_evidence_and_the_docs_show_them():
    raised = raised_reasons()
    assert {"worker_killed", "scratch_full", "appworld_server_killed", "grading_infra_failure"} <= raised
    assert raised <= QUARANTINE_EVIDENCE.keys(), raised - QUARANTINE_EVIDENCE.keys()
    assert QUARANTINE_EVIDENCE.keys() <= raised, QUARANTINE_EVIDENCE.keys() - raised  # no stale entry
    assert all(what and why for what, why in QUARANTINE_EVIDENCE.values())
    assert evidence_table() in (ROOT / "docs" / "environments.md").read_text(), (
        "docs/environments.md: the table is stale"
    )


@pytest.fixture
def small_filesystem(tmp_path):
    """An 8 MiB tmpfs (root only: it mounts one), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs")
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_filesystem_is_another_tenants_only_when_the_policys_folders_hold_little_of_it(small_filesystem):
    policy = small_filesystem / "episode"
    policy.mkdir()
    (policy / "answer.txt").write_text("42")
    assert full_scratch(policy, lambda: [policy]) is None  # room left
    fill(small_filesystem / "tenant.bin")
    evidence = full_scratch(policy, lambda: [policy])
    assert evidence is not None and "another tenant filled it" in evidence
    (small_filesystem / "tenant.bin").unlink()
    fill(policy / "junk")  # the policy fills it itself
    assert full_scratch(policy, lambda: [policy]) is None
    (policy / "junk").unlink()
    for n in range(4):
        (policy / f"link{n}").symlink_to("/")  # counted as links, never followed
    fill(small_filesystem / "tenant.bin")
    assert full_scratch(policy, lambda: [policy]) is not None


def test_usage_counts_each_inode_once_at_any_depth_on_its_own_device(tmp_path):
    """A tree deeper than Python's recursion limit (a policy can make one) is measured, and removed by
    `remove_tree` (`shutil.rmtree` raises RecursionError on it)."""
    from canopy.envs.isolation.base import remove_tree

    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        for _ in range(1500):
            os.mkdir("d")
            os.chdir("d")
        Path("data").write_bytes(b"x" * 65536)
        os.link("data", tmp_path / "again")
    finally:
        os.chdir(here)
    size, inodes = usage([tmp_path], os.stat(tmp_path).st_dev)
    assert 65536 <= size < 65536 + 1500 * 8192 and inodes == 1500 + 1
    remove_tree(tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]
