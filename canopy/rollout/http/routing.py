"""Which server serves each generate request, and its retries. Routing is sticky per episode: its first turn goes to
the healthy server with the fewest requests in flight, and its later turns follow, so its growing prefix stays in
that server's cache. A server that fails a request (connection error, 5xx) is ejected; the health watcher re-admits it
once /health answers and it serves the fleet's weight version (re-synced first, when the backend's weight sync can
bring one server up to date). Retries go to another server. With a gateway URL the requests go to the backend's
gateway instead, the episode id in its routing header. A request still failing after `max_retries` retries comes back
as an `EngineFault`."""

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from canopy.rollout.engine import EngineFault, Generation
from canopy.rollout.http.client import TRANSIENT, HTTPError, request
from canopy.rollout.http.fleet import Fleet, Server

ROUTES_KEPT = 1 << 16  # sticky routes remembered


class Aborted(Exception):
    """The server aborted the request (a weight sync paused it): worth another try."""


class StaleSampleError(RuntimeError):
    """A server returned a sample from weights other than the engine's current version (strict on-policy violated)."""


class Router:
    """Sends each generate request of an episode to its server (or the gateway), ejecting and re-admitting servers.
    `resync(server)`, when given, brings a recovered server on other weights up to the fleet's version."""

    def __init__(
        self,
        fleet: Fleet,
        retry_backoff_s: float,
        health_interval_s: float,
        gateway_url: str | None = None,
        resync: Callable[[Server], None] | None = None,
    ):
        self.fleet, self.settings, self.backend = fleet, fleet.settings, fleet.backend
        self.retry_backoff_s, self.health_interval_s, self.resync = retry_backoff_s, health_interval_s, resync
        self.lock = threading.Lock()
        # a gateway in front of the servers, when given: the data plane, pinned per episode by its routing key
        self.gateway = Server(gateway_url.rstrip("/")) if gateway_url else None
        # episode key -> (its server, the server of its first turn): sticky routing, least recently used dropped first
        self.routes: OrderedDict[str, tuple[Server, Server]] = OrderedDict()
        self.counts = Counter()  # turns, on_first_server, ejections, readmissions, relaunches, stale_refusals, resyncs
        self.watcher: threading.Thread | None = None
        self.closing = False

    def generate(self, body: dict, key: str | None, parse: Callable[[dict], Generation]) -> Generation | EngineFault:
        """POST `body` to the episode's server and `parse` the reply, retrying an aborted, 5xx, timed-out or refused
        request (on another server when there is one); a request the server rejects as invalid raises. A sample from
        other weights is discarded and its server ejected (one restarted at the same address holds the base weights
        until re-synced); if every try gets one, no server has the engine's weights and it raises."""
        failed, error, name = None, None, self.backend.name
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * attempt)
            server = self._acquire(avoid=failed, key=key)
            header = self.backend.routing_header
            headers = {header: key} if server is self.gateway and key is not None and header else None
            try:
                url = server.url + self.backend.generate_path
                return parse(request(url, body, self.settings.request_timeout_s, headers))
            except HTTPError as e:
                if e.status < 500 and e.status not in (408, 429):
                    raise RuntimeError(
                        f"{name} {server.url} rejected a {self.backend.generate_path} request: {e}; "
                        "check the budget against the server's context length"
                    ) from None
                failed, error = server, e
                if e.status >= 500:
                    self.eject(server)
            except Aborted as e:  # the server chose to abort (a weight sync pauses it): not a sick server
                failed, error = server, e
            except (StaleSampleError, *TRANSIENT) as e:
                failed, error = server, e
                self.eject(server)
            finally:
                self._release(server)
        if isinstance(error, StaleSampleError):
            raise error
        return EngineFault("engine_request_failed", f"{attempt + 1} tries, last on {failed.url}: {error!r}")

    def forget(self, keys: Iterable[str]) -> None:
        """These episodes ended: drop their routes."""
        with self.lock:
            for key in keys:
                self.routes.pop(key, None)

    def close(self) -> None:
        """Stop the health watcher (after its current round)."""
        self.closing = True

    def _acquire(self, avoid: Server | None, key: str | None = None) -> Server:
        """The episode's server (`key`), sticky from its first turn so that its prefix stays in that server's cache;
        on a first turn, or when its server is ejected or just failed (`avoid`), the healthy server with the fewest
        requests in flight, which the episode then keeps. Ejected servers take requests only when none is healthy.
        With a gateway every request goes to it, and it keeps the episode on one server."""
        with self.lock:
            if self.gateway is not None:
                self.gateway.outstanding += 1
                self.counts["turns"] += key is not None
                return self.gateway
            servers = self.fleet.servers
            healthy = [s for s in servers if not s.ejected and s is not avoid]
            candidates = healthy or [s for s in servers if s is not avoid] or servers
            server, first = self.routes.pop(key, (None, None))
            if server not in candidates:
                server = min(candidates, key=lambda s: s.outstanding)
            if key is not None:
                self.routes[key] = (server, first or server)  # (re)inserted last: the most recently used
                while len(self.routes) > ROUTES_KEPT:
                    self.routes.popitem(last=False)
                self.counts["turns"] += 1
                self.counts["on_first_server"] += server is (first or server)
            server.outstanding += 1
            return server

    def eject(self, server: Server) -> None:
        """Take a failing server out of routing; the health watcher re-admits it once /health answers and it serves the
        fleet's weight version. The gateway is never ejected: it routes around its own failing servers, and its
        requests are retried like any other."""
        with self.lock:
            if server.ejected or server is self.gateway:
                return
            server.ejected = True
            self.counts["ejections"] += 1
            if self.watcher is None or not self.watcher.is_alive():
                self.watcher = threading.Thread(target=self._watch_ejected, name="engine-health", daemon=True)
                self.watcher.start()

    def _watch_ejected(self) -> None:
        while not self.closing:
            with self.lock:
                ejected = [s for s in self.fleet.servers if s.ejected]
            if not ejected:
                return
            time.sleep(self.health_interval_s)
            for server in ejected:
                if self._serves_fleet_weights(server):
                    with self.lock:
                        server.ejected = False
                        self.counts["readmissions"] += 1

    def _serves_fleet_weights(self, server: Server) -> bool:
        """Healthy, and serving the fleet's weights: a restarted server holds others, and is refused until re-synced
        (by `resync`, when there is one). A launched server whose process died is launched again first."""
        if self.fleet.revive(server):
            self.counts["relaunches"] += 1
        try:
            request(server.url + "/health", None, timeout=5)
            if self.fleet.served_version(server, timeout=5) == str(self.fleet.weight_version):
                return True
        except (HTTPError, *TRANSIENT):
            return False
        self.counts["stale_refusals"] += 1
        if self.resync is None:
            return False
        try:
            self.resync(server)
        except (RuntimeError, HTTPError, *TRANSIENT):
            return False
        self.counts["resyncs"] += 1
        return True

    def _release(self, server: Server) -> None:
        with self.lock:
            server.outstanding -= 1
