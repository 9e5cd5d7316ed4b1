"""JSON over HTTP to an inference server: one call, its errors sorted into HTTP statuses and transient faults."""

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request

TRANSIENT = (OSError, http.client.HTTPException, json.JSONDecodeError)  # connection refused / reset, timeouts, garbled


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def request(url: str, body: dict | None, timeout: float, headers: dict | None = None, method: str | None = None):
    """GET (no body) or POST JSON (`method` overrides either); returns the decoded JSON reply (or its text). Raises
    HTTPError on a non-2xx status."""
    data = None if body is None else json.dumps(body).encode()
    outgoing = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method=method
    )
    try:
        with urllib.request.urlopen(outgoing, timeout=timeout) as reply:
            text = reply.read().decode()
    except urllib.error.HTTPError as error:
        raise HTTPError(error.code, error.read().decode(errors="replace")[:500]) from None
    return json.loads(text) if text.startswith(("{", "[")) else text


def client_host(bind: str) -> str:
    """Where this process reaches a server it launched bound to `bind` (a wildcard bind answers on loopback)."""
    return "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind


def is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine only (localhost, 127.0.0.0/8, ::1)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"
