"""The trainer's end of vLLM's NCCL weight transfer (`--weight-transfer-config '{"backend": "nccl"}'`), without vLLM
in the trainer's venv: the few libnccl calls it needs, bound with ctypes as vLLM binds them
(vllm/distributed/device_communicators/pynccl_wrapper.py; tests/test_vllm_contract.py holds the two equal).

The rendezvous is vLLM's for a trainer that cannot join its TCPStore: the trainer mints an `ncclUniqueId` and hands it
to the server in /init_weight_transfer_engine (`nccl_unique_id_b64`); every rank then enters ncclCommInitRank at
once, and each of vLLM's workers issues a one-element float32 sum all_reduce straight after it
(`PyNcclCommunicator._init_comm`), which the trainer must match before any other collective."""

import base64
import ctypes
import importlib.util
from pathlib import Path

import torch

UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
SUM = 0  # ncclRedOp_t ncclSum
DTYPES = {  # ncclDataType_t
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


Result, Comm, Buffer, Stream = ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
SIGNATURES = {  # name -> (return type, argument types), as nccl.h declares them
    "ncclGetErrorString": (ctypes.c_char_p, [Result]),
    "ncclGetUniqueId": (Result, [ctypes.POINTER(UniqueId)]),
    "ncclCommInitRank": (Result, [ctypes.POINTER(Comm), ctypes.c_int, UniqueId, ctypes.c_int]),
    "ncclAllReduce": (Result, [Buffer, Buffer, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, Comm, Stream]),
    "ncclBroadcast": (Result, [Buffer, Buffer, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, Comm, Stream]),
    "ncclCommAbort": (Result, [Comm]),
}


def library_path() -> str:
    """libnccl.so.2 from the nvidia-nccl wheel beside CUDA torch, else the loader's search path."""
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / "lib" / "libnccl.so.2").exists():
            return str(Path(folder) / "lib" / "libnccl.so.2")
    return "libnccl.so.2"


class NCCL:
    """libnccl, its calls checked: a failing one raises with NCCL's own message."""

    def __init__(self, path: str | None = None):
        path = path or library_path()
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as error:
            raise RuntimeError(
                f"engine.vllm.weight_sync=nccl cannot load {path} ({error}): install torch's CUDA build (its "
                "nvidia-nccl wheel), or use engine.vllm.weight_sync=disk"
            ) from None
        for name, (restype, argtypes) in SIGNATURES.items():
            function = getattr(self.lib, name)
            function.restype, function.argtypes = restype, argtypes

    def check(self, result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"{call} failed: NCCL error {result} ({self.lib.ncclGetErrorString(result).decode()})")

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES))


def encode_unique_id(uid: bytes) -> str:
    """Standard base64 (vLLM refuses the URL-safe alphabet)."""
    return base64.b64encode(uid).decode()


class Communicator:
    """Rank 0 of one NCCL group: the trainer, and at ranks 1.. a server's workers."""

    def __init__(self, nccl: NCCL, uid: bytes, world_size: int, device: torch.device):
        self.nccl, self.device = nccl, device
        uid_struct = UniqueId.from_buffer_copy(uid)
        comm = Comm()
        with torch.cuda.device(device):
            nccl.check(nccl.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid_struct, 0), "ncclCommInitRank")
            self.comm = comm
            self.stream = torch.cuda.Stream(device)  # its own: a stuck peer blocks only this group's transfers
            warmup = torch.zeros(1, device=device)  # vLLM's warm-up all_reduce, matched
            self._call("ncclAllReduce", warmup.data_ptr(), warmup.data_ptr(), 1, DTYPES[torch.float32], SUM)
            self.stream.synchronize()

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send `tensor` (contiguous, on this device) to every rank, on this group's stream after the current one."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._call("ncclBroadcast", tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), DTYPES[tensor.dtype], 0)
        tensor.record_stream(self.stream)

    def done(self) -> bool:
        """Whether every transfer enqueued so far has completed."""
        return self.stream.query()

    def abort(self) -> None:
        """Tear the group down without its peers (one died mid-transfer): pending transfers end."""
        if self.comm is not None:
            self.nccl.lib.ncclCommAbort(self.comm)
            self.comm = None

    def _call(self, name: str, *args) -> None:
        self.nccl.check(getattr(self.nccl.lib, name)(*args, self.comm, self.stream.cuda_stream), name)


class Transport:
    """What the weight sync opens groups with: NCCL on the trainer's current GPU (`NCCLWeightSync`'s `transport`)."""

    def __init__(self, path: str | None = None):
        self.nccl = NCCL(path)
        self.device = torch.device("cuda", torch.cuda.current_device())

    def unique_id(self) -> bytes:
        return self.nccl.unique_id()

    def join(self, uid: bytes, world_size: int) -> Communicator:
        return Communicator(self.nccl, uid, world_size, self.device)
