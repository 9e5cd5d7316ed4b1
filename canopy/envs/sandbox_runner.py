"""Runs one action's Python code inside the sandbox; started by `canopy.envs.sandbox` as
`python -I -S sandbox_runner.py SCRATCH LIMITS_JSON` with the code on stdin. Standard library only.
`python -I -S sandbox_runner.py --exec WRITABLE_JSON VIEW_JSON PARENT_PID -- COMMAND...` instead confines a
long-lived server that runs the policy's code itself (AppWorld's): no network, writes only beneath WRITABLE, each
path VIEW names "hidden" an empty read-only folder (a mount namespace of its own; WRITABLE and "shown" paths beneath
one stay; then no capabilities either), dies with its parent, may signal no process but itself and never send
SIGKILL (`deny_foreign_signals`: so a SIGKILL death of the server came from outside it), then execs COMMAND.

Before the code runs, the process confines itself, in this order: its own network namespace (no network),
resource limits (CPU seconds, address space, file size, processes, no core dumps), an unprivileged user of
its own when started as root (so the process limit counts only its own processes and it can signal nothing
else), death with its parent, and a Landlock ruleset that allows writes only beneath SCRATCH (and to
/dev/null). Setup failures exit with EXIT_SETUP: that is the serving layer's fault, not the agent's. Once
confined, the runner writes one byte to the parent's `ready_fd` and closes it, so that the code's own exit
with status EXIT_SETUP is not mistaken for a setup failure.
"""

import ctypes
import errno
import json
import os
import resource
import signal
import sys
import traceback

EXIT_SETUP, EXIT_MEMORY, EXIT_PROCESSES = 70, 75, 76

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 22, 24, 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH = 1
# Landlock filesystem rights that create, change or remove files (ABI 1; REFER from 2; TRUNCATE from 3).
WRITE_FILE, REMOVE_DIR, REMOVE_FILE, MAKE_ALL = 1 << 1, 1 << 4, 1 << 5, sum(1 << b for b in range(6, 13))
REFER, TRUNCATE = 1 << 13, 1 << 14
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
SECCOMP_MODE_FILTER, SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 2, 0x7FFF0000, 0x00050000
BPF_LD_ABS, BPF_JEQ, BPF_JGE, BPF_RET = 0x20, 0x15, 0x35, 0x06  # classic BPF: ld [k]; jeq/jge #k; ret #k
# architecture -> (AUDIT_ARCH, {syscall: (the argument holding the target pid, the one holding the signal)}); pidfd
# and tkill (a thread id alone) calls are refused outright (None)
SIGNAL_CALLS = {
    "x86_64": (0xC000003E, {62: (0, 1), 234: (0, 2), 129: (0, 1), 297: (0, 2), 200: None, 424: None}),
    "aarch64": (0xC00000B7, {129: (0, 1), 131: (0, 2), 138: (0, 1), 240: (0, 2), 130: None, 424: None}),
}

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def isolate_network() -> None:
    """A fresh network namespace has only a down loopback device: no connection can leave it."""
    if os.geteuid() == 0:
        _check(libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        return
    uid, gid = os.getuid(), os.getgid()  # unprivileged: a user namespace that maps us to ourselves
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
    for path, text in (
        ("/proc/self/setgroups", "deny"),
        ("/proc/self/uid_map", f"{uid} {uid} 1"),
        ("/proc/self/gid_map", f"{gid} {gid} 1"),
    ):
        with open(path, "w") as f:
            f.write(text)


def set_limits(limits: dict) -> None:
    cpu, memory = limits["cpu_seconds"], limits["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises OSError(EFBIG) in the code instead


def drop_privileges(uid) -> None:
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def die_with_parent(parent_pid: int) -> None:
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(EXIT_SETUP)


def restrict_writes(*writable: str) -> None:
    """Landlock: writes only beneath the `writable` paths (and to /dev/null); TCP bind/connect denied where the
    ABI has it."""
    abi = _check(
        libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)), "Landlock ABI"
    )
    handled = (
        WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_ALL | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    )
    attr = RulesetAttr(
        handled,
        NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0,
    )
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = _check(
        libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)),
        "landlock_create_ruleset",
    )
    for path, allowed in [(p, handled) for p in writable] + [("/dev/null", WRITE_FILE | (TRUNCATE if abi >= 3 else 0))]:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneathAttr(allowed, fd)
        _check(
            libc.syscall(
                SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)
            ),
            f"landlock_add_rule({path})",
        )
        os.close(fd)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


def _mount(source, target: str, fstype, flags: int, options) -> None:
    encode = lambda text: text.encode() if text is not None else None  # noqa: E731
    _check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(options)), f"mount {target}")


def private_mount_namespace() -> None:
    """A mount namespace of this process's own: nothing it mounts reaches the parent's namespace."""
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)


def hide(hidden: list[str], keep: list[str]) -> None:
    """In a mount namespace of our own, each `hidden` path becomes an empty read-only folder; `keep` paths beneath
    one are bound back in place. Shallower paths are hidden first, so a hidden path may lie inside a kept one."""
    private_mount_namespace()
    kept = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in keep}
    for path in sorted(hidden, key=lambda p: p.count("/")):
        _mount("tmpfs", path, "tmpfs", 0, "size=64k,mode=0755")
        for inner, fd in kept.items():
            if inner.startswith(path.rstrip("/") + "/"):
                os.makedirs(inner, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", inner, None, MS_BIND | MS_REC, None)
        _mount(None, path, None, MS_REMOUNT | MS_RDONLY, None)
    for fd in kept.values():
        os.close(fd)
    os.chdir(os.getcwd())  # the working folder as the new mounts show it (relative paths would see the old one)


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def signal_filter(machine: str, pid: int) -> list[tuple[int, int, int, int]]:
    """A seccomp program (classic BPF) under which signals reach only `pid` and SIGKILL reaches nothing; every other
    system call passes. Another ABI's system calls (x32, i386 through int 0x80) are refused."""
    if machine not in SIGNAL_CALLS:
        raise OSError(errno.ENOSYS, f"seccomp: no signal filter for the {machine} architecture")
    arch, calls = SIGNAL_CALLS[machine]
    deny, allow = (BPF_RET, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM), (BPF_RET, 0, 0, SECCOMP_RET_ALLOW)
    program = [(BPF_LD_ABS, 0, 0, 4), (BPF_JEQ, 1, 0, arch), deny, (BPF_LD_ABS, 0, 0, 0)]  # arch, then the number
    if machine == "x86_64":
        program += [(BPF_JGE, 0, 1, 0x40000000), deny]  # the x32 ABI
    for number, slots in calls.items():  # each check ends in a return, or leaves the number loaded for the next
        if slots is None:
            program += [(BPF_JEQ, 0, 1, number), deny]
            continue
        target, sig = (16 + 8 * index for index in slots)  # the low 32 bits of seccomp_data.args[index]
        program += [
            (BPF_JEQ, 0, 6, number),
            (BPF_LD_ABS, 0, 0, sig), (BPF_JEQ, 2, 0, signal.SIGKILL),
            (BPF_LD_ABS, 0, 0, target), (BPF_JEQ, 1, 0, pid),
            deny, allow,
        ]  # fmt: skip
    return program + [allow]


def deny_foreign_signals() -> None:
    """Install `signal_filter` for this process (kept across exec, inherited by every child)."""
    program = signal_filter(os.uname().machine, os.getpid())
    filters = (SockFilter * len(program))(*(SockFilter(*instruction) for instruction in program))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    fprog = SockFprog(len(program), filters)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


def drop_capabilities() -> None:
    """Empty the bounding set, so the exec'd command has no capabilities even as root (no setns back out of the
    mount namespace, no ptrace, no reading past file permissions)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for capability in range(last + 1):
        _check(libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {capability})")


def confine_and_exec(writable: list[str], view: dict, parent_pid: int, command: list[str]) -> None:
    try:
        isolate_network()
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        die_with_parent(parent_pid)
        if view["hidden"]:
            hide(view["hidden"], keep=writable + view["shown"])
        restrict_writes(*writable)
        if view["hidden"]:
            drop_capabilities()  # no setns back out of the mount namespace
        deny_foreign_signals()
    except OSError as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        os._exit(EXIT_SETUP)
    os.execv(command[0], command)


def main() -> None:
    if sys.argv[1] == "--exec":
        return confine_and_exec(json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[6:])
    scratch, limits = sys.argv[1], json.loads(sys.argv[2])
    code = sys.stdin.read()
    try:
        isolate_network()
        set_limits(limits)
        drop_privileges(limits["uid"])
        die_with_parent(limits["parent_pid"])
        restrict_writes(scratch)
        os.chdir(scratch)
        os.write(limits["ready_fd"], b"1")  # confined: from here on, an exit status is the code's own
        os.close(limits["ready_fd"])
    except OSError as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        os._exit(EXIT_SETUP)
    try:
        exec(compile(code, "<action>", "exec"), {"__name__": "__main__"})
    except MemoryError:
        print("MemoryError: the code exceeded the sandbox memory limit", file=sys.stderr)
        os._exit(EXIT_MEMORY)
    except BlockingIOError as error:
        if error.errno != errno.EAGAIN:
            raise
        print("BlockingIOError: the code exceeded the sandbox process limit", file=sys.stderr)
        os._exit(EXIT_PROCESSES)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
