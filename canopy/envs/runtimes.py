"""Sandbox runtimes for repository tasks (SWE-bench, Appendix H): one protocol, three back ends, and `auto`.

A `Runtime` starts a `Sandbox` from an image; a sandbox runs shell commands in the task's working directory
(`/testbed`), each in a fresh `bash -lc` subshell as mini-swe-agent's environments do, with no network and the
episode's limits (Table A3: 2 CPU, 6 GB; a process cap). Files written by one command are seen by the next;
processes do not outlive their command.

- `bwrap`: bubblewrap on a per-sandbox overlay. The image is an unpacked root file system under `image_root`
  (`<image_root>/<image name, '/' and ':' as '_'>/rootfs`, the layout of an OCI bundle: `skopeo copy` + `umoci
  unpack` on a cluster, `python -m canopy.tools.swe_data generate` here). Every command mounts the overlay
  (image read-only, the sandbox's own upper layer) inside a mount namespace of its own, so no mount outlives
  the command, even when its worker is killed. Limits come from a cgroup per sandbox (v1 or v2; root), named by
  the pool's worker slot so a dead worker's cgroups are removed with it. Needs no daemon; runs rootless in a
  user namespace too (then the memory cap is a per-process address-space limit: cgroups need root here).
  An image with `canopy-image.json` `{"base": "host"}` holds only its `testbed/`; the host's /usr and /etc are
  bound read-only beneath it (CI's generated tasks).
- `docker` / `podman`: a container per sandbox (`--network none --cpus --memory --pids-limit`), commands by
  `exec`, labelled with the worker slot so a dead worker's containers are removed with it.
- `auto`: `bwrap` when `image_root` is set, else `docker` when its daemon answers, else `podman`.

`RuntimeUnavailable` (the machine cannot run this runtime) is a setup error with its fix; `SandboxError` (one
sandbox failed to start or to run a command) and `ImageMissing` are the serving layer's faults.
"""

import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from canopy.errors import require

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_V1_CONTROLLERS = ("memory", "pids", "cpu")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_BASE = ("/usr", "/etc")  # bound read-only under a host-based image (with /bin, /lib... linked into /usr)
SLOT_TAG = "CANOPY_SANDBOX_TAG"  # set by the pool per worker slot: names the slot's cgroups and containers
LABEL = "canopy.slot"
CONTAINER_MARKER = "container-runtime"  # in a worker's scratch folder: the docker or podman its sandboxes use
PODMAN_FLAGS = ("--runtime", "runc", "--cgroup-manager", "cgroupfs")  # crun fails on hybrid cgroups (design notes)


class RuntimeUnavailable(RuntimeError):
    """This machine cannot run the runtime; the message names the fix."""


class SandboxError(RuntimeError):
    """A sandbox could not be started, or could not run a command: the serving layer's fault."""


class ImageMissing(SandboxError):
    """The task's image is not on this machine (the image-cache step of `canopy.tools.swe_data` puts it there)."""


@dataclass(frozen=True)
class RuntimeSettings:
    """`env.swebench.runtime.*`."""

    kind: str = "auto"  # auto | bwrap | docker | podman
    image_root: str | None = None  # bwrap: unpacked images, <image_root>/<safe name>/rootfs
    cpus: float = 2.0
    memory_mb: int = 6144
    pids: int = 1024
    workdir: str = "/testbed"
    max_output_bytes: int = 1_000_000  # per command; the head and tail halves are kept past it

    def validate(self) -> None:

        prefix = "env.swebench.runtime"
        require(
            self.kind in ("auto", "bwrap", "docker", "podman"),
            f"{prefix}.kind={self.kind!r} is unknown: use auto, bwrap, docker or podman",
        )
        for key in ("cpus", "memory_mb", "pids", "max_output_bytes"):
            require(getattr(self, key) > 0, f"{prefix}.{key}={getattr(self, key)} must be > 0")
        require(
            self.kind != "bwrap" or self.image_root is not None,
            f"{prefix}.kind=bwrap needs {prefix}.image_root: the folder of unpacked images",
        )


@dataclass(frozen=True)
class CommandResult:
    output: str  # stdout and stderr interleaved
    returncode: int
    timed_out: bool = False


def safe_image_name(image: str) -> str:
    """The folder name of an image under `image_root`."""
    return image.replace("/", "_").replace(":", "_")


def _read_output(file, cap: int) -> str:
    """A command's output file as text; past `cap` bytes, its first and last `cap / 2` with a note between."""
    size = file.seek(0, os.SEEK_END)
    file.seek(0)
    if size <= cap:
        return file.read().decode("utf-8", errors="replace")
    head = file.read(cap // 2)
    file.seek(size - cap // 2)
    note = f"\n[canopy: {size - cap} bytes elided]\n".encode()
    return (head + note + file.read()).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------- cgroups


class Cgroup:
    """One sandbox's cgroup (v1: memory, pids and cpu hierarchies; v2: the unified one), under `canopy/`."""

    def __init__(self, name: str, settings: RuntimeSettings):
        v1 = _cgroup_v1()
        if v1:
            self.paths = [CGROUP_ROOT / c / "canopy" / name for c in CGROUP_V1_CONTROLLERS]
        else:
            _enable_v2_controllers()
            self.paths = [CGROUP_ROOT / "canopy" / name]
        for path in self.paths:
            path.mkdir(parents=True, exist_ok=True)
        memory, period = settings.memory_mb << 20, 100_000
        if v1:
            memory_dir, pids_dir, cpu_dir = self.paths
            (memory_dir / "memory.limit_in_bytes").write_text(str(memory))
            swap = memory_dir / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(memory))
            (pids_dir / "pids.max").write_text(str(settings.pids))
            (cpu_dir / "cpu.cfs_period_us").write_text(str(period))
            (cpu_dir / "cpu.cfs_quota_us").write_text(str(int(settings.cpus * period)))
        else:
            (path,) = self.paths
            (path / "memory.max").write_text(str(memory))
            (path / "pids.max").write_text(str(settings.pids))
            (path / "cpu.max").write_text(f"{int(settings.cpus * period)} {period}")

    def enter(self) -> None:
        """Move the calling process in (run in the command's child before it execs)."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        for path in self.paths:
            _remove_cgroup(path)


def _cgroup_v1() -> bool:
    return (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists()


def _enable_v2_controllers() -> None:
    root = CGROUP_ROOT / "canopy"
    root.mkdir(exist_ok=True)
    for folder in (CGROUP_ROOT, root):
        (folder / "cgroup.subtree_control").write_text("+memory +pids +cpu")


def cgroups_usable() -> bool:
    """Root with a writable cgroup hierarchy (v1 or v2)."""
    if os.geteuid() != 0:
        return False
    probe = CGROUP_ROOT / ("pids" if _cgroup_v1() else "") / "canopy"
    try:
        probe.mkdir(parents=True, exist_ok=True)
        return os.access(probe, os.W_OK)
    except OSError:
        return False


def _members(path: Path) -> list[int]:
    """The pids in a cgroup (none once it is gone)."""
    procs = path / "cgroup.procs"
    return [int(pid) for pid in procs.read_text().split()] if procs.exists() else []


def _sigkill(pids) -> None:
    """SIGKILL each pid; one already gone, or not this process's to signal, is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _remove_cgroup(path: Path) -> None:
    """Kill everything in the cgroup (and below), then remove it."""
    if not path.is_dir():
        return
    for child in [p for p in path.iterdir() if p.is_dir()]:
        _remove_cgroup(child)
    deadline = time.monotonic() + 10
    while True:
        pids = _members(path)
        _sigkill(pids)
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SandboxError(f"cgroup {path} still holds processes {pids} after SIGKILL") from None
            time.sleep(0.01)


def release_slot(tag: str, scratch: Path) -> None:
    """Remove everything a worker slot's sandboxes left: cgroups, and the containers of the docker or podman its
    runtime named in `scratch` (the worker's scratch folder). Called by the pool when it stops a worker (which may
    have been killed mid-episode)."""
    for root in [CGROUP_ROOT / c / "canopy" for c in CGROUP_V1_CONTROLLERS] + [CGROUP_ROOT / "canopy"]:
        if root.is_dir():
            for path in root.glob(f"{tag}-*"):
                _remove_cgroup(path)
    marker = scratch / CONTAINER_MARKER
    if not marker.is_file():
        return
    executable = marker.read_text().strip()
    command = [executable, *(PODMAN_FLAGS if executable == "podman" else ())]
    try:
        listing = subprocess.run(
            [*command, "ps", "-aq", "--filter", f"label={LABEL}={tag}"], capture_output=True, text=True, timeout=60
        )
        if listing.returncode == 0 and listing.stdout.split():
            subprocess.run([*command, "rm", "-f", *listing.stdout.split()], capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{executable} did not answer while removing the containers of {tag}") from None


# ---------------------------------------------------------------------------------------------------- bwrap


class BwrapRuntime:
    """Bubblewrap on an overlay of the unpacked image (see the module docstring)."""

    name = "bwrap"

    def __init__(self, settings: RuntimeSettings, scratch: str | Path | None = None):
        self.settings = settings
        self.image_root = Path(settings.image_root)
        self.scratch = Path(scratch or os.environ.get("CANOPY_SCRATCH_ROOT") or tempfile.gettempdir()) / "sandboxes"
        self.rootless = os.geteuid() != 0
        self.cgroups = cgroups_usable()

    @staticmethod
    def check(settings: RuntimeSettings) -> None:
        if shutil.which("bwrap") is None:
            raise RuntimeUnavailable(
                "bubblewrap is not installed: apt-get install bubblewrap (or pick another runtime)"
            )
        if shutil.which("unshare") is None:
            raise RuntimeUnavailable("util-linux's unshare is missing: apt-get install util-linux")
        if not Path(settings.image_root).is_dir():
            raise RuntimeUnavailable(
                f"env.swebench.runtime.image_root={settings.image_root} does not exist: unpack the images there "
                "(python -m canopy.tools.swe_data cache-images, or generate for the toy tasks)"
            )
        probe = BwrapRuntime(settings)
        try:
            probe._probe()
        except SandboxError as error:
            raise RuntimeUnavailable(f"bubblewrap cannot start a sandbox here ({error}): {probe._fix()}") from None

    def _fix(self) -> str:
        if self.rootless:
            return "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1) or run as root"
        return "the kernel needs overlayfs and mount namespaces (modprobe overlay)"

    def _probe(self) -> None:
        """Mount an overlay of an empty image and run `true` in it."""
        with tempfile.TemporaryDirectory(prefix="canopy-bwrap-probe-") as folder:
            image = Path(folder) / "image"
            (image / "rootfs" / "testbed").mkdir(parents=True)
            (image / "canopy-image.json").write_text(json.dumps({"base": "host"}))
            sandbox = BwrapSandbox(self, image, Path(folder) / "sandbox", None)
            result = sandbox.run("true", timeout=60)
            if result.returncode != 0:
                raise SandboxError(result.output.strip() or f"exit {result.returncode}")

    def image_dir(self, image: str) -> Path:
        return self.image_root / safe_image_name(image)

    def has_image(self, image: str) -> bool:
        return (self.image_dir(image) / "rootfs").is_dir()

    def start(self, image: str) -> "BwrapSandbox":
        if not self.has_image(image):
            raise ImageMissing(f"image {image} is not unpacked under {self.image_root}")
        name = f"{os.environ.get(SLOT_TAG, 'canopy')}-{uuid.uuid4().hex[:12]}"
        try:
            cgroup = Cgroup(name, self.settings) if self.cgroups else None
        except OSError as error:
            raise SandboxError(f"cgroup {name}: {error}") from None
        return BwrapSandbox(self, self.image_dir(image), self.scratch / name, cgroup)


class BwrapSandbox:
    def __init__(self, runtime: BwrapRuntime, image_dir: Path, home: Path, cgroup: Cgroup | None):
        self.runtime, self.settings, self.home, self.cgroup = runtime, runtime.settings, home, cgroup
        config = image_dir / "canopy-image.json"
        self.host_base = config.is_file() and json.loads(config.read_text()).get("base") == "host"
        self.rootfs = image_dir / "rootfs"
        self.environment = _image_environment(image_dir / "config.json")
        for folder in ("upper", "work", "merged", "tmp"):
            (home / folder).mkdir(parents=True, exist_ok=True)

    def _command(self, command: str, env: dict[str, str], status_fd: int) -> list[str]:
        merged = self.home / "merged"
        overlay = f"lowerdir={self.rootfs},upperdir={self.home / 'upper'},workdir={self.home / 'work'}" + (
            ",userxattr" if self.runtime.rootless else ""
        )
        bwrap = ["bwrap", "--cap-drop", "ALL", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
        for key, value in {**self.environment, **env}.items():
            bwrap += ["--setenv", key, value]
        if self.host_base:
            bwrap += [arg for path in HOST_BASE for arg in ("--ro-bind", path, path)]
            bwrap += [
                arg
                for d in ("bin", "lib", "lib64", "sbin")
                if Path(f"/{d}").is_symlink()
                for arg in ("--symlink", f"usr/{d}", f"/{d}")
            ]
            bwrap += ["--bind", str(merged / "testbed"), "/testbed", "--bind", str(self.home / "tmp"), "/tmp"]
        else:
            bwrap += ["--bind", str(merged), "/"]
        bwrap += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--json-status-fd",
            str(status_fd),
            "--chdir",
            self.settings.workdir,
        ]
        bwrap += ["bash", "-lc", command]
        script = (
            f"mount -t overlay overlay -o {shlex.quote(overlay)} {shlex.quote(str(merged))} && exec {shlex.join(bwrap)}"
        )
        namespace = ["unshare", "--mount", "--propagation", "private"]
        if self.runtime.rootless:
            namespace[1:1] = ["--user", "--map-root-user"]
        return [*namespace, "--", "sh", "-c", script]

    def run(self, command: str, timeout: float, stdin: bytes | None = None, env: dict | None = None) -> CommandResult:
        """`bash -lc command` in the sandbox; past `timeout` seconds everything it started is killed."""
        status_read, status_write = os.pipe()
        memory = self.settings.memory_mb << 20

        def enter_limits():  # in the child, before it execs; a pool worker's address-space cap stays on top
            if self.cgroup is not None:
                self.cgroup.enter()
            else:  # rootless: no cgroup, a per-process address-space cap instead
                hard = resource.getrlimit(resource.RLIMIT_AS)[1]
                cap = memory if hard == resource.RLIM_INFINITY else min(memory, hard)
                resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

        with tempfile.TemporaryFile() as output:
            try:
                process = subprocess.Popen(
                    self._command(command, env or {}, status_write),
                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    pass_fds=(status_write,),
                    preexec_fn=enter_limits,
                    start_new_session=True,
                )
            except (OSError, subprocess.SubprocessError) as error:
                os.close(status_read)
                os.close(status_write)
                raise SandboxError(f"cannot start bwrap: {error}") from None
            os.close(status_write)
            if stdin is not None:
                try:
                    process.stdin.write(stdin)
                    process.stdin.close()
                except BrokenPipeError:
                    pass
            timed_out = False
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            self._kill(process)
            with os.fdopen(status_read) as status:
                reports = [json.loads(line) for line in status.read().splitlines() if line.strip()]
            text = _read_output(output, self.settings.max_output_bytes)
        # bwrap reports the command's exit code when the command ran; without one, the sandbox never set up
        exit_code = next((report["exit-code"] for report in reports if "exit-code" in report), None)
        if exit_code is None and not timed_out:
            raise SandboxError(f"the sandbox did not start: {text.strip()[-300:] or f'exit {process.returncode}'}")
        return CommandResult(text, -signal.SIGKILL if exit_code is None else exit_code, timed_out)

    def _kill(self, process: subprocess.Popen) -> None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        if self.cgroup is not None:  # anything that escaped the process group (it cannot escape the cgroup)
            _sigkill(_members(self.cgroup.paths[0]))

    def close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
        shutil.rmtree(self.home, ignore_errors=True)


def _image_environment(config: Path) -> dict[str, str]:
    """The image's environment variables (an OCI bundle's config.json, else docker's image config), or a PATH."""
    environment = {"PATH": DEFAULT_PATH, "HOME": "/root"}
    if config.is_file():
        data = json.loads(config.read_text())
        listed = (data.get("process") or {}).get("env") or (data.get("config") or {}).get("Env") or []
        environment.update(item.split("=", 1) for item in listed if "=" in item)
    return environment


# ---------------------------------------------------------------------------------------------------- containers


class ContainerRuntime:
    """docker or podman: one container per sandbox, commands by `exec` (see the module docstring)."""

    def __init__(self, settings: RuntimeSettings, executable: str):
        self.settings, self.executable, self.name = settings, executable, executable
        self.prefix = [executable, *(PODMAN_FLAGS if executable == "podman" else ())]
        if os.environ.get("CANOPY_SCRATCH_ROOT"):  # a pool worker: tell `release_slot` whose containers to remove
            scratch = Path(os.environ["CANOPY_SCRATCH_ROOT"])
            scratch.mkdir(parents=True, exist_ok=True)
            (scratch / CONTAINER_MARKER).write_text(executable)

    @staticmethod
    def check(settings: RuntimeSettings, executable: str) -> None:
        if shutil.which(executable) is None:
            raise RuntimeUnavailable(f"{executable} is not installed: apt-get install {executable}, or use bwrap")
        probe = subprocess.run([executable, "info"], capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            raise RuntimeUnavailable(
                f"{executable} does not answer ({(probe.stderr.strip().splitlines() or ['?'])[-1]}): start its daemon "
                "without a network bridge (docs/environments.md, SWE-bench), or use env.swebench.runtime.kind=bwrap"
            )

    def has_image(self, image: str) -> bool:
        return subprocess.run([*self.prefix, "image", "inspect", image], capture_output=True).returncode == 0

    def start(self, image: str) -> "ContainerSandbox":
        if not self.has_image(image):
            raise ImageMissing(f"image {image} is not in the {self.executable} store")
        s = self.settings
        limits = [
            "--network",
            "none",
            "--cpus",
            str(s.cpus),
            "--memory",
            f"{s.memory_mb}m",
            "--pids-limit",
            str(s.pids),
        ]
        if self.executable == "podman":  # explicit rlimits, within this process's own (it cannot raise them)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            limits += ["--ulimit", f"nproc={s.pids}:{s.pids}", "--ulimit", f"nofile={soft}:{hard}"]
        tag = os.environ.get(SLOT_TAG, "canopy")
        run = [
            *self.prefix,
            "run",
            "-d",
            "--pull",
            "never",
            "--init",
            "--label",
            f"{LABEL}={tag}",
            *limits,
            "-w",
            s.workdir,
        ]
        started = subprocess.run(
            [*run, "--entrypoint", "sleep", image, "infinity"], capture_output=True, text=True, timeout=300
        )
        if started.returncode != 0:
            raise SandboxError(f"{self.executable} run {image}: {started.stderr.strip()[-300:]}")
        return ContainerSandbox(self, started.stdout.strip())


class ContainerSandbox:
    """A container (its init reaps) in which every process but the init and its `sleep` is killed after each
    command: as under bwrap, nothing a command starts outlives it, and a backgrounded fork bomb cannot exhaust the
    pids limit of the commands after it."""

    def __init__(self, runtime: ContainerRuntime, container: str):
        self.runtime, self.container = runtime, container
        self.keep = set(self._host_pids())

    def _host_pids(self) -> list[int]:
        host_pid = ["hpid"] if self.runtime.executable == "podman" else ["-eo", "pid"]  # host pids, not the container's
        listing = subprocess.run(
            [*self.runtime.prefix, "top", self.container, *host_pid], capture_output=True, text=True
        )
        return [int(pid) for pid in listing.stdout.split()[1:] if pid.isdigit()]

    def _kill_leftovers(self) -> None:
        _sigkill(set(self._host_pids()) - self.keep)

    def run(self, command: str, timeout: float, stdin: bytes | None = None, env: dict | None = None) -> CommandResult:
        exec_args = [*self.runtime.prefix, "exec", "-i", "-w", self.runtime.settings.workdir]
        for key, value in (env or {}).items():
            exec_args += ["-e", f"{key}={value}"]
        # the container's own `timeout` kills the command inside; the client's deadline is only a backstop
        inner = ["timeout", "-s", "KILL", str(int(timeout)), "bash", "-lc", command]
        started = time.monotonic()
        with tempfile.TemporaryFile() as output:
            try:
                process = subprocess.run(
                    [*exec_args, self.container, *inner],
                    input=stdin or b"",
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    timeout=timeout + 30,
                )
            except subprocess.TimeoutExpired:
                raise SandboxError(
                    f"{self.runtime.executable} exec did not return within {timeout + 30:.0f} s"
                ) from None
            text = _read_output(output, self.runtime.settings.max_output_bytes)
        self._kill_leftovers()
        if process.returncode in (125, 126) and "Error response from daemon" in text:
            raise SandboxError(text.strip()[-300:])
        timed_out = process.returncode == 128 + signal.SIGKILL and time.monotonic() - started >= timeout
        return CommandResult(text, process.returncode, timed_out)

    def close(self) -> None:
        subprocess.run([*self.runtime.prefix, "rm", "-f", self.container], capture_output=True)


# ---------------------------------------------------------------------------------------------------- choosing


def resolve_kind(settings: RuntimeSettings) -> str:
    """The runtime `auto` stands for on this machine (see the module docstring)."""
    if settings.kind != "auto":
        return settings.kind
    if settings.image_root is not None:
        return "bwrap"
    for executable in ("docker", "podman"):
        if shutil.which(executable):
            try:
                ContainerRuntime.check(settings, executable)
                return executable
            except (RuntimeUnavailable, subprocess.TimeoutExpired):
                continue
    raise RuntimeUnavailable(
        "env.swebench.runtime.kind=auto found no runtime: set env.swebench.runtime.image_root to unpacked images "
        "(bwrap), or start a docker / podman daemon"
    )


def check_runtime(settings: RuntimeSettings) -> str:
    """Raise `RuntimeUnavailable` with the fix unless this machine can run the runtime; returns its kind."""
    kind = resolve_kind(settings)
    if kind == "bwrap":
        BwrapRuntime.check(settings)
    else:
        ContainerRuntime.check(settings, kind)
    return kind


def build_runtime(settings: RuntimeSettings, scratch: str | Path | None = None):
    kind = resolve_kind(settings)
    return BwrapRuntime(settings, scratch) if kind == "bwrap" else ContainerRuntime(settings, kind)
