"""Bounds on the decoder's port (mlx-lm): what one client may hold, and for how long.

mlx-lm serves each connection on a thread of its own and waits on a socket for as long as the
client likes (a slow client holds its thread; many slow clients hold the server), reads any body
its Content-Length announces, and parses JSON as deep as it comes. The seam's server and handler
bound all of it:

  - a whole request (request line, headers, body) must arrive within `request_deadline_s` of the
    connection's start or of its last response, else the connection is closed (slowloris);
  - at most `max_per_client` connections per client address, and `max_total` in all, still
    waiting for their request: a new connection past either takes the place of the oldest such
    one (a client that sends its request at once, as the front door does, always gets in; one
    that trickles is the oldest). Connections being served are not capped per client (the front
    door holds one per request in flight, all from 127.0.0.1); MAX_CONNECTIONS threads serve at
    most;
  - a body of at most `max_body_bytes`, judged from Content-Length before anything is read (413);
    a chunked body is refused (411) and so is a missing or invalid length on a body (400);
  - request line and header lines: BaseHTTPRequestHandler's own limits (65,536 bytes a line,
    100 headers), kept;
  - JSON nested at most MAX_JSON_DEPTH deep (400 bad_json, never a RecursionError's 500).
"""

import ipaddress
import json
import logging
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any, Dict, Optional

from .errors import SeamError, bad_request

log = logging.getLogger("hetero_mlx")

DEFAULT_REQUEST_DEADLINE_S = 10.0
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
DEFAULT_MAX_BODY_MB = 64
MAX_JSON_DEPTH = 64


# ---- bodies -------------------------------------------------------------------------------


def body_length(headers: Any, max_bytes: int) -> int:
    """The body's length from its headers, before anything of it is read: 0 without one; 411
    for a chunked (or any transfer-coded) body, 400 for an invalid length, 413 past max_bytes."""
    if headers.get("Transfer-Encoding") is not None:
        raise SeamError(411, "length_required", "chunked bodies are not supported: send Content-Length")
    values = headers.get_all("Content-Length") or []
    if not values:
        return 0
    if len(values) > 1 or not values[0].strip().isdigit():
        raise bad_request("bad_length", f"invalid Content-Length {', '.join(values)!r}")
    n_bytes = int(values[0])
    if n_bytes > max_bytes:
        raise SeamError(
            413, "body_too_large", f"the body has {n_bytes} bytes; this decoder takes at most "
            f"{max_bytes} (serve --max-body-mb)",
        )
    return n_bytes


def json_depth(value: Any) -> int:
    """How deep containers nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def loads_bounded(raw: bytes) -> Any:
    """json.loads of a request body, nesting bounded: any failure is a 400 bad_json."""
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request("bad_json", f"invalid JSON in request body: {e}") from None
    except RecursionError:
        raise bad_request("bad_json", f"JSON nested deeper than {MAX_JSON_DEPTH}") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise bad_request("bad_json", f"JSON nested deeper than {MAX_JSON_DEPTH}")
    return value


# ---- hosts --------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (a loopback address or "localhost")."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: str, allow_remote: bool) -> None:
    """The seam serves on loopback unless told otherwise: the front door is on this machine."""
    if not is_loopback(host) and not allow_remote:
        raise SystemExit(
            f"hetero_mlx: --host {host} is not a loopback address; the decoder's port serves "
            "the front door on this machine. Pass --allow-remote to serve other machines too"
        )


# ---- connections --------------------------------------------------------------------------


class ConnectionBounds:
    """Per-client connection counts and per-connection request deadlines, with a reaper thread
    that shuts the socket of any connection past its deadline (its handler then reads EOF)."""

    def __init__(self, request_deadline_s: float, max_per_client: int, max_total: int = 512):
        self.request_deadline_s = request_deadline_s
        self.max_per_client = max_per_client
        self.max_total = max_total
        self._lock = threading.Lock()
        self._per_client: Dict[str, int] = {}
        self._deadlines: Dict[socket.socket, Optional[float]] = {}
        self._clients: Dict[socket.socket, str] = {}
        self.closed_late = 0  # connections closed by the deadline
        self.refused = 0  # connections closed at once: every one of their kind was being served
        self.evicted = 0  # waiting connections closed to make room for a new one
        self._refused_logged = 0.0
        threading.Thread(target=self._reap, name="hetero-deadlines", daemon=True).start()

    def _oldest_waiting(self, client: Optional[str]) -> Optional[socket.socket]:
        """The connection (of `client`, or of anyone) whose request deadline is nearest: the one
        that has waited longest for its request. With the lock."""
        waiting = [(d, s) for s, d in self._deadlines.items() if d is not None and d >= 0
                   and (client is None or self._clients.get(s) == client)]
        return min(waiting, key=lambda x: x[0])[1] if waiting else None

    def _held(self, client: Optional[str]) -> int:
        """Connections counted against the caps: those still waiting for their request (not
        closed by the reaper or an eviction). Connections being served are not counted: the
        decoder's one legitimate client, the front door, holds one for every request it has in
        flight, all from 127.0.0.1 (a soak's 64 clients were refused at the 65th); MAX_CONNECTIONS
        bounds them."""
        return sum(1 for s, d in self._deadlines.items() if d is not None and d >= 0
                   and (client is None or self._clients.get(s) == client))

    def _evict(self, sock: socket.socket) -> None:
        self._deadlines[sock] = -1.0  # arrived() now says too late
        self.evicted += 1
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def admit(self, sock: socket.socket, client: str) -> bool:
        """Counts a new connection in, its deadline running. Past a cap, the oldest connection
        still waiting for its request (its client's, or anyone's for the total) makes room;
        False when there is none (every connection is being served)."""
        with self._lock:
            for who, cap in ((client, self.max_per_client), (None, self.max_total)):
                if self._held(who) < cap:
                    continue
                victim = self._oldest_waiting(who)
                if victim is None:
                    self.refused += 1
                    if time.monotonic() - self._refused_logged > 5:
                        self._refused_logged = time.monotonic()
                        log.warning("closing a new connection from %s: %s connections are all "
                                    "being served", client, "its" if who else "the server's")
                    return False
                self._evict(victim)
            self._per_client[client] = self._per_client.get(client, 0) + 1
            self._deadlines[sock] = time.monotonic() + self.request_deadline_s
            self._clients[sock] = client
            return True

    def release(self, sock: socket.socket, client: str) -> None:
        with self._lock:
            self._deadlines.pop(sock, None)
            self._clients.pop(sock, None)
            held = self._per_client.get(client, 0) - 1
            if held > 0:
                self._per_client[client] = held
            else:
                self._per_client.pop(client, None)

    def waiting(self, sock: socket.socket) -> None:
        """The connection waits for its next request: the deadline runs from now."""
        with self._lock:
            if sock in self._deadlines:
                self._deadlines[sock] = time.monotonic() + self.request_deadline_s

    def arrived(self, sock: socket.socket) -> bool:
        """The whole request is in: no deadline while it is served. False if it came too late
        (the socket is already shut)."""
        with self._lock:
            if sock not in self._deadlines:
                return True
            deadline = self._deadlines[sock]
            if deadline is not None and deadline < 0:
                return False
            self._deadlines[sock] = None
            return True

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return {
                "open": len(self._deadlines),
                "closed_late": self.closed_late,
                "refused": self.refused,
                "evicted": self.evicted,
            }

    def _reap(self) -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self._lock:
                late = [s for s, d in self._deadlines.items() if d is not None and 0 <= d < now]
                for sock in late:
                    self._deadlines[sock] = -1.0  # marked: arrived() now says too late
                    self.closed_late += 1
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass


class SeamHTTPServer(ThreadingHTTPServer):
    """mlx-lm's server class (a thread per connection) with bounds: a listen backlog that a
    burst of clients does not overflow (socketserver's default is 5: under 64 clients at once
    the front door's tokenize call was reset; soak, RESULTS §15.3), at most MAX_CONNECTIONS
    connections served at once (more wait in the backlog), at most `max_per_client` from one
    address, and a deadline for each request to arrive (ConnectionBounds). `configured` makes
    the subclass serve.py hands to mlx-lm's _run_http_server, which constructs the class."""

    request_queue_size = 512
    daemon_threads = True
    MAX_CONNECTIONS = 512
    request_deadline_s = DEFAULT_REQUEST_DEADLINE_S
    max_per_client = DEFAULT_MAX_CONNECTIONS_PER_CLIENT
    max_body_bytes = DEFAULT_MAX_BODY_MB << 20

    @classmethod
    def configured(cls, request_deadline_s: float, max_per_client: int, max_body_mb: int) -> type:
        attrs = dict(
            request_deadline_s=request_deadline_s,
            max_per_client=max_per_client,
            max_body_bytes=max_body_mb << 20,
        )
        return type(cls.__name__, (cls,), attrs)

    def __init__(self, *args: Any, **kwargs: Any):
        self._slots = threading.BoundedSemaphore(self.MAX_CONNECTIONS)
        self.bounds = ConnectionBounds(self.request_deadline_s, self.max_per_client,
                                       max_total=self.MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.bounds.admit(request, str(client_address[0])):
            self.shutdown_request(request)
            return
        self._slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            self.bounds.release(request, str(client_address[0]))
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.bounds.release(request, str(client_address[0]))
            self._slots.release()
