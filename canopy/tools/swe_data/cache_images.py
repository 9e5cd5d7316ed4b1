"""`cache-images` materializes each instance's image before training, so training never pulls: unpacked under an
image root for the bwrap runtime (`skopeo copy` + `umoci unpack`), or pulled into the docker / podman store. It
needs a registry, so it runs on a connected machine.
"""

import shutil
import subprocess
from pathlib import Path


def cache_command(image: str, image_root: Path, tool: str) -> list[list[str]]:
    """Commands that put `image` where the runtime finds it without a registry."""
    from canopy.envs.isolation import safe_image_name

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
    from canopy.envs.isolation import safe_image_name

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
