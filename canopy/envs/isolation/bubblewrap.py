"""`bwrap`: bubblewrap on a per-sandbox overlay.

The image is an unpacked root file system under `image_root` (`<image_root>/<image name, '/' and ':' as '_'>/rootfs`,
the layout of an OCI bundle: `skopeo copy` + `umoci unpack` on a cluster, `python -m canopy.tools.swe_data
generate` here). Every command mounts the overlay (image read-only, the sandbox's own upper layer) inside a mount
namespace of its own, so no mount outlives the command, even when its worker is killed. Limits come from a cgroup
per sandbox (`canopy.envs.isolation.cgroups`). Needs no daemon; runs rootless in a user namespace too (then the
memory cap is a per-process address-space limit: cgroups need root here). An image with `canopy-image.json`
`{"base": "host"}` holds only its `testbed/`; the host's /usr and /etc are bound read-only beneath it (CI's
generated tasks).
"""

import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

from canopy.envs.attribution import policy_folders
from canopy.envs.isolation.base import (
    SLOT_TAG,
    CommandResult,
    ImageMissing,
    RuntimeSettings,
    RuntimeUnavailable,
    SandboxError,
    read_output,
    remove_tree,
    safe_image_name,
    sigkill,
)
from canopy.envs.isolation.cgroups import Cgroup, cgroup_members, cgroups_usable

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_BASE = ("/usr", "/etc")  # bound read-only under a host-based image (with /bin, /lib... linked into /usr)


class BwrapRuntime:
    """Bubblewrap on an overlay of the unpacked image (see the module docstring)."""

    name = "bwrap"
    measures_writes = True  # `writable_folders` lists where its sandboxes write, under `scratch`

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

    def writable_folders(self) -> list[Path]:
        """The folders the policy's commands can write, this worker's and its pool's siblings' (`attribution`): the
        sandboxes' upper layers and /tmp folders, beside `scratch`."""
        return policy_folders(self.scratch.parent, ("sandboxes/*/upper", "sandboxes/*/tmp"))

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
            text = read_output(output, self.settings.max_output_bytes)
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
            sigkill(cgroup_members(self.cgroup.paths[0]))

    def close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
        remove_tree(self.home)


def _image_environment(config: Path) -> dict[str, str]:
    """The image's environment variables (an OCI bundle's config.json, else docker's image config), or a PATH."""
    environment = {"PATH": DEFAULT_PATH, "HOME": "/root"}
    if config.is_file():
        data = json.loads(config.read_text())
        listed = (data.get("process") or {}).get("env") or (data.get("config") or {}).get("Env") or []
        environment.update(item.split("=", 1) for item in listed if "=" in item)
    return environment
