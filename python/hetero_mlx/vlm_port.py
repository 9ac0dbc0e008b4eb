"""Bounds on mlx-vlm's port (DeepSeek-V4): uvicorn's h11 protocol with bounds.ConnectionBounds.

mlx-vlm's server is uvicorn with its h11 protocol (httptools is not installed), which has a
keep-alive timeout (a connection silent for 5 s after a response is closed) but no deadline for a
request: a client that sends a byte every few seconds holds its connection as long as it likes,
and any number of clients may. BoundedH11Protocol is uvicorn's H11Protocol with the same bounds,
and the same ConnectionBounds object and rules, as mlx-lm's port (bounds.py):

  - a whole request (request line, headers, body: h11's EndOfMessage) must arrive within
    `request_deadline_s` of the connection's start or of its last response, else ConnectionBounds'
    reaper shuts the socket (the event loop then reads EOF and closes the connection);
  - at most `max_per_client` connections per client address and `max_total` in all still
    waiting for their request; a new connection past either takes the place of the one that has
    waited longest (the front door, which sends whole requests at once from 127.0.0.1, always
    gets in), and is closed at once only when every connection of its kind is being served;
  - the request line and headers: at most MAX_HEAD_BYTES in all, else 431 and the connection
    is closed (h11 bounds a head still arriving, uvicorn's reply is a 400; a head that came
    whole in one read is measured here);
  - bodies are SeamGate's (vlm_gate.py): Content-Length past --max-body-mb is 413 before any
    body byte is read, chunked is 411, and either reply closes the connection.

vlm_serve.serve hands the class to uvicorn.run (`http=`), with `ws="none"` (see port_options).
"""

import json
from typing import Any, Dict, Optional

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from .bounds import ConnectionBounds
from .errors import SeamError

# h11's default bound on a request line and headers still arriving (16 KiB): kept, and named.
MAX_HEAD_BYTES = 16 * 1024


def _head_bytes(request: h11.Request) -> int:
    """About how many bytes a request line and its headers took on the wire."""
    line = len(request.method) + len(request.target) + 12
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items())


class _BoundedConnection(h11.Connection):
    """h11's server-side connection that tells its protocol when a request has wholly arrived,
    and keeps the status h11 suggests for a request it cannot parse (431 for an oversized
    head)."""

    def __init__(self, protocol: "BoundedH11Protocol", max_head_bytes: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self._protocol = protocol
        self.max_head_bytes = max_head_bytes
        self.error_status = 400

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint
            raise
        if isinstance(event, h11.Request) and _head_bytes(event) > self.max_head_bytes:
            # h11 bounds a head still arriving; one that came whole in a single read is not.
            self.error_status = 431
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        # A request's end while its response is still to come (not the rest of a body that an
        # early error reply left unread: that connection is closing).
        if isinstance(event, h11.EndOfMessage) and self.our_state in (
            h11.SEND_RESPONSE,
            h11.SEND_BODY,
        ):
            self._protocol.request_arrived()
        return event


class BoundedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol, each connection admitted, timed and released by `bounds`."""

    bounds: ConnectionBounds  # set by configured()

    @classmethod
    def configured(cls, bounds: ConnectionBounds) -> type:
        return type(cls.__name__, (cls,), {"bounds": bounds})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.conn = _BoundedConnection(
            self, self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        )
        self._sock: Optional[Any] = None  # the transport's socket, while admitted
        self._host = ""

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        self._host = str(self.client[0]) if self.client else ""
        if sock is None or not self.bounds.admit(sock, self._host):
            transport.close()  # every connection of its kind is being served
            return
        self._sock = sock

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self._sock is not None:
            self.bounds.release(self._sock, self._host)
            self._sock = None
        super().connection_lost(exc)

    def request_arrived(self) -> None:
        """The request is whole: no deadline while it is served. One that came too late (its
        socket already shut by the reaper) is dropped: the app reads a disconnect."""
        if self._sock is not None and not self.bounds.arrived(self._sock):
            self.transport.close()

    def on_response_complete(self) -> None:
        if self._sock is not None:  # the next request's deadline runs from this response
            self.bounds.waiting(self._sock)
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's reply to a request h11 cannot parse, with h11's status (431: the request
        line and headers exceed MAX_HEAD_BYTES) and the seam's JSON error; then closed."""
        status = getattr(self.conn, "error_status", 400)
        if status == 431:
            error = SeamError(431, "headers_too_large", "the request line and headers exceed "
                              f"{self.conn.max_head_bytes} bytes")
        else:
            error = SeamError(status, "bad_http", msg)
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers,
                                   reason=STATUS_PHRASES.get(status, b"")),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def port_options(bounds: ConnectionBounds) -> Dict[str, Any]:
    """uvicorn.run's options for the bounded port. `ws="none"`: no WebSocket upgrade (mlx-vlm's
    /v1/realtime), whose connection would leave the bounded protocol and SeamGate's signature
    check (an upgrade request is then an ordinary, signed HTTP request)."""
    return {
        "http": BoundedH11Protocol.configured(bounds),
        "ws": "none",
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }
