"""`engine.sglang.*`: the SGLang engine's settings, each checked before anything starts, and the dtype its servers
compute in (known without launching them)."""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from canopy.errors import is_int, require
from canopy.models.hf_checkpoint import checkpoint_dtype
from canopy.rollout.http.client import is_loopback


@dataclass
class SGLangSettings:
    """`engine.sglang.*` (conf/engine/sglang.yaml): the schema and the only defaults of those keys."""

    python: str | None = None  # the SGLang venv's python, to launch servers (conf/train.yaml: $CANOPY_SGLANG_PYTHON)
    urls: list[str] = field(default_factory=list)  # attach to running servers instead (e.g. [http://10.0.0.5:30000]);
    # they must see model.path
    router_url: str | None = None  # SGLang's model gateway (smg, --policy manual) for /generate, keyed by episode;
    # control traffic still goes to each server of urls (or the launched ones)
    num_servers: int = 1  # servers to launch on rank 0's node: ports base_port + i, GPUs base_gpu_id + i * tp_size on
    base_port: int = 30000
    host: str = "127.0.0.1"  # launched servers' bind address: 0.0.0.0 (or this node's address) to serve other machines
    base_gpu_id: int = 0  # on GPUs: at least trainer.devices (the trainer holds GPUs 0..devices-1 of rank 0's node)
    tp_size: int = 1
    mem_fraction: float = 0.8  # --mem-fraction-static (weights + KV cache)
    extra_args: list[str] = field(default_factory=list)  # more launch_server flags, e.g. [--dtype, bfloat16]
    weight_sync: str = "disk"  # disk (safetensors + update_weights_from_disk) | distributed (broadcast from rank 0)
    sync_dir: str = ".cache/sglang"  # v<version>/ weight dirs and server logs; the servers must see it
    sync_master_addr: str = "127.0.0.1"  # distributed: rank 0's address and port for the weight-sync group
    # (reachable by the servers: not loopback when they run elsewhere)
    sync_master_port: int = 29600
    sync_backend: str = "nccl"  # distributed: nccl (trainer and servers on different GPUs) | gloo
    concurrency: int = 256  # requests in flight, over all servers
    request_timeout_s: float = 3600.0
    max_retries: int = 3  # per request; then its episode is quarantined (engine_request_failed)
    startup_timeout_s: float = 900.0

    def validate(self, accelerator: str, trainer_devices: int = 1) -> None:
        """Launch (python) or attach (urls), ports, sizes, GPUs apart from the trainer's, weight sync reachable from
        the servers, and request limits: one line naming the fix on the first bad value."""

        urls = list(self.urls or [])
        require(
            bool(urls) or bool(self.python),
            "engine.sglang.python is not set: point it at the SGLang venv's python (or export CANOPY_SGLANG_PYTHON), "
            "or attach to running servers with engine.sglang.urls=[http://host:port]",
        )
        require(
            all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls),
            f"engine.sglang.urls={urls}: each must be a server URL like http://host:30000",
        )
        require(
            self.router_url is None or str(self.router_url).startswith(("http://", "https://")),
            f"engine.sglang.router_url={self.router_url}: must be null or the gateway's URL, like http://host:30080",
        )
        for key in ("num_servers", "tp_size", "concurrency", "base_port", "sync_master_port"):
            require(
                is_int(getattr(self, key)) and getattr(self, key) >= 1,
                f"engine.sglang.{key}={getattr(self, key)} must be a positive integer",
            )
        require(
            is_int(self.base_gpu_id) and self.base_gpu_id >= 0,
            f"engine.sglang.base_gpu_id={self.base_gpu_id} must be >= 0",
        )
        require(
            isinstance(self.mem_fraction, (int, float)) and 0 < self.mem_fraction < 1,
            f"engine.sglang.mem_fraction={self.mem_fraction} must lie in (0, 1), e.g. 0.8",
        )
        gpus = range(self.base_gpu_id, self.base_gpu_id + self.num_servers * self.tp_size)
        require(
            bool(urls) or accelerator == "cpu" or gpus.start >= trainer_devices,
            f"engine.sglang launches {self.num_servers} server(s) x tp {self.tp_size} on {gpu_names(gpus)}, but the "
            f"trainer uses {gpu_names(range(trainer_devices))} of that node (trainer.devices={trainer_devices}): "
            f"set engine.sglang.base_gpu_id={trainer_devices} (GPUs after the trainer's), or run "
            "the servers on other nodes and attach with engine.sglang.urls (colocation is not supported)",
        )
        remote = [u for u in urls if not is_loopback(u)]
        require(
            not (self.weight_sync == "distributed" and remote and is_loopback(f"//{self.sync_master_addr}")),
            f"engine.sglang.sync_master_addr={self.sync_master_addr} is a loopback address, but the servers "
            f"{remote} are on other machines and must reach the trainer's rank 0 there: set it to this node's "
            "address on their network",
        )
        require(
            self.weight_sync in ("disk", "distributed"),
            f"engine.sglang.weight_sync={self.weight_sync!r} is unknown: use disk or distributed",
        )
        require(
            self.sync_backend in ("nccl", "gloo"),
            f"engine.sglang.sync_backend={self.sync_backend!r} is unknown: use nccl or gloo",
        )
        require(
            not (self.weight_sync == "distributed" and self.sync_backend == "nccl" and accelerator == "cpu"),
            "engine.sglang.weight_sync=distributed over nccl broadcasts from the trainer's GPU: set "
            "trainer.accelerator=gpu, "
            "or use engine.sglang.weight_sync=disk",
        )
        require(self.sync_dir is not None, "engine.sglang.sync_dir is not set: give a directory the servers can read")
        for key in ("request_timeout_s", "startup_timeout_s"):
            require(
                isinstance(getattr(self, key), (int, float)) and getattr(self, key) > 0,
                f"engine.sglang.{key}={getattr(self, key)} must be > 0 seconds",
            )
        require(
            is_int(self.max_retries) and self.max_retries >= 0,
            f"engine.sglang.max_retries={self.max_retries} must be >= 0",
        )

    def compute_dtype(self, model_path: str | Path) -> str:
        """The dtype the servers will compute in, known before launching them (`serving_dtype`)."""
        return serving_dtype(self.extra_args, model_path)


def gpu_names(gpus: range) -> str:
    return f"GPU {gpus.start}" if len(gpus) == 1 else f"GPUs {gpus.start}-{gpus.stop - 1}"


def serving_dtype(extra_args: list[str], model_path: str | Path) -> str:
    """The dtype SGLang computes in: `--dtype` when given, else its "auto" rule on the checkpoint's config.json
    (a float32 checkpoint is served in float16, one that declares none in bfloat16). The audit's gap bounds are
    chosen by it."""
    args = list(extra_args)
    given = args[args.index("--dtype") + 1] if "--dtype" in args[:-1] else "auto"
    if given != "auto":
        return {"half": "float16", "float": "float32"}.get(given, given)
    declared = checkpoint_dtype(Path(model_path))
    if declared is None:
        return "bfloat16"
    return "float16" if declared == torch.float32 else str(declared).removeprefix("torch.")
