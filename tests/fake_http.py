"""What the fake inference servers share (tests/fake_sglang.py, tests/fake_vllm.py): a stdlib HTTP server in a thread
that records every request as a `Call`, answers a method or path outside its route table as FastAPI would (404 for
an unknown path, 405 for a known path under another method), and replies JSON."""

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple


class Call(NamedTuple):
    """One request as the fake saw it (path and body first: tests index them), with its answer."""

    path: str  # without the query string
    body: dict | None
    method: str
    status: int | None = None
    reply: dict | None = None
    query: dict = {}


class FakeServer:
    """Serves `answer(request, method, path, body)` -> (status, JSON reply), or None to drop the connection, for the
    routes of `routes` ((method, path) pairs; None: answer any)."""

    def __init__(self, port: int, routes: frozenset | None):
        self.routes, self.calls, self.lock = routes, [], threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                fake.handle(self, "GET")

            def do_POST(self):
                fake.handle(self, "POST")

            def do_PUT(self):
                fake.handle(self, "PUT")

            def do_DELETE(self):
                fake.handle(self, "DELETE")

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

    def answer(self, request, method, path, body):
        raise NotImplementedError

    def handle(self, request, method):
        parts = urllib.parse.urlsplit(request.path)
        data = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        body = json.loads(data) if data else None
        with self.lock:
            index = len(self.calls)
            self.calls.append(Call(parts.path, body, method, query=dict(urllib.parse.parse_qsl(parts.query))))
        answer = self.refused(method, parts.path) or self.answer(request, method, parts.path, body)
        if answer is None:  # dropped
            return
        status, payload = answer
        with self.lock:
            self.calls[index] = self.calls[index]._replace(status=status, reply=payload)
        self.reply(request, payload, status)

    def refused(self, method, path):
        if self.routes is None or (method, path) in self.routes:
            return None
        if any(known == path for _, known in self.routes):
            return 405, {"detail": "Method Not Allowed"}
        return 404, {"detail": "Not Found"}

    @staticmethod
    def reply(request, payload, status=200):
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)
