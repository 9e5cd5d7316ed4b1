"""A fake SGLang HTTP server (stdlib only, in a thread) for the engine tests; `tests/fake_sglang_launch/` runs it as
`python -m sglang.launch_server` so that launching and relaunching can be tested too. Its route table is the routes
Canopy calls, each with the method SGLang serves it under; tests/test_sglang_contract.py checks both against the
SGLang release the Makefile pins."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fake_http import FakeServer

# (method, path) of every route Canopy calls; anything else is answered as FastAPI would: 404 for an unknown path,
# 405 for a known path under another method
ROUTES = frozenset(
    {
        ("GET", "/health"),
        ("GET", "/health_generate"),
        ("GET", "/model_info"),
        ("POST", "/generate"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/begin_weight_update"),
        ("POST", "/update_weights_from_distributed"),
        ("POST", "/end_weight_update"),
    }
)


class FakeSGLang(FakeServer):
    """Records every request as a `Call`; /generate replies `reply_ids` (cut at max_new_tokens) stamped with the
    version the last weight update set, after `delay` seconds (or `delay(body)`). `failures` scripts the next
    /generate replies: abort, 500, 400 or drop. `routes` is the route table (None: answer any method and path)."""

    def __init__(self, reply_ids=(7, 8, 2), delay=0.0, port=0, routes=ROUTES):
        super().__init__(port, routes)
        self.reply_ids, self.delay = list(reply_ids), delay
        self.failures: list[str] = []
        self.fail_prefix: list[int] | None = None  # /generate of prompts starting with these ids answers 500
        self.version, self.report_version = "default", None

    def answer(self, request, method, path, body):
        """(status, JSON reply) to one request, or None to drop the connection."""
        if path == "/generate":
            with self.lock:
                failure = self.failures.pop(0) if self.failures else None
            time.sleep(self.delay(body) if callable(self.delay) else self.delay)
            if failure == "drop":
                request.close_connection = True
                return None
            failing_prompt = self.fail_prefix and body["input_ids"][: len(self.fail_prefix)] == self.fail_prefix
            if failure in ("500", "400") or failing_prompt:
                return int(failure or 500), {"error": {"message": "boom"}}
            return 200, self.generation(body, aborted=failure == "abort")
        if path == "/model_info":
            return 200, {"weight_version": self.version, "model_path": "x"}
        if body and body.get("weight_version") is not None:
            self.version = body["weight_version"]
        return 200, {"success": True, "message": "ok"}

    def generation(self, body, aborted):
        params = body["sampling_params"]
        ids = self.reply_ids[: params["max_new_tokens"]]
        finish = {"type": "length", "length": len(ids)}
        if ids[-1] in params["stop_token_ids"]:
            finish = {"type": "stop", "matched": ids[-1]}
        if aborted:
            finish = {"type": "abort", "message": "Abort before prefill"}
        meta = {
            "finish_reason": finish,
            "weight_version": self.report_version or self.version,
            "output_token_logprobs": [[-(k + 1) / 4, t, None] for k, t in enumerate(ids)],
        }
        return {"text": "", "output_ids": ids, "meta_info": meta}


class FakeGateway:
    """A fake of SGLang's model gateway under its manual policy: /generate is forwarded to one of `backends`, pinned
    by the `X-SMG-Routing-Key` header (a new key goes to the backend with the fewest keys). Records every (path,
    key, backend index); anything but /generate is refused, as the gateway has no weight-update endpoints."""

    def __init__(self, backends: list[FakeSGLang]):
        self.backends, self.calls, self.pinned = backends, [], {}
        self.lock = threading.Lock()
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                gateway.forward(self, self.rfile.read(int(self.headers["Content-Length"])))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def forward(self, request, data: bytes):
        import urllib.error
        import urllib.request

        key = request.headers.get("X-SMG-Routing-Key")
        with self.lock:
            if key not in self.pinned:
                counts = [list(self.pinned.values()).count(i) for i in range(len(self.backends))]
                self.pinned[key] = counts.index(min(counts))
            backend = self.pinned[key]
            self.calls.append((request.path, key, backend))
        if request.path != "/generate":
            return FakeSGLang.reply(request, {"error": {"message": f"no {request.path} on the gateway"}}, 404)
        upstream = urllib.request.Request(
            self.backends[backend].url + "/generate", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(upstream, timeout=60) as reply:
                return FakeSGLang.reply(request, json.loads(reply.read()))
        except urllib.error.HTTPError as error:
            return FakeSGLang.reply(request, json.loads(error.read()), error.code)

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
