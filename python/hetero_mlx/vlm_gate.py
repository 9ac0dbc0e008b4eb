"""SeamGate: the ASGI middleware in front of mlx-vlm's app (vlm_serve.py), outermost.

What it does for every request on the decoder's port, before mlx-vlm sees it: the signature
(access.py), the body's size and framing (bounds.py), the tenant's salt (tenants.py) turned into
mlx-vlm's own tenant header, a dead generation thread reported instead of waited on, and no
CORS on the seam's own /hetero/ paths; while mlx-vlm serves it, a caller that hangs up stops
its generations (vlm_cancel.py); and the loader mlx-vlm's endpoints reach refuses any model but
the served one (guard_loader). The connection's own bounds (deadline, per-client caps, header
bytes) are the protocol's (vlm_port.py).
"""

import functools
import importlib
import json
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

from fastapi import HTTPException

from .bounds import body_length, loads_bounded
from .checks import check_vlm_body
from .errors import SeamError, bad_request
from .tenants import SALT_FIELD, take_salt
from .vlm_cancel import watched

PREFIX = "/hetero/"
# mlx-vlm's own tenant headers (server/app.py _read_tenant_id): APC mixes the tenant into every
# prefix-cache key. The seam sets them from the body's salt and takes a caller's own off.
TENANT_HEADERS = (b"x-apc-tenant", b"x-tenant-id")


class Admissions:
    """The decoder's requests in flight, by the epoch (/hetero/clear) they were admitted in.

    mlx-vlm stores prefix checkpoints during a request's prefill, from its generation thread,
    with nothing that names the request. After a clear, while any request admitted before it
    is still in flight, no checkpoint is stored (VlmSeam guards APC's store): one of them
    could be that request's, computed before the clear. Only speed is lost."""

    def __init__(self) -> None:
        self.epoch = 0
        self.dropped = 0  # checkpoints not stored
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def admitted(self) -> Iterator[None]:
        with self._lock:
            epoch = self.epoch
            self._counts[epoch] += 1
        try:
            yield
        finally:
            with self._lock:
                self._counts[epoch] -= 1
                if not self._counts[epoch]:
                    del self._counts[epoch]

    def new_epoch(self) -> None:
        with self._lock:
            self.epoch += 1

    def in_flight(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def older_in_flight(self) -> bool:
        with self._lock:
            return any(epoch < self.epoch for epoch in self._counts)


class ModelNotServed(HTTPException):
    """A seam refusal raised inside mlx-vlm's endpoints, which re-raise HTTPExceptions (and
    answer 500 for anything else); the app's handler for it answers the seam's JSON error."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(status_code=status, detail=message)
        self.error = SeamError(status, code, message)


def guard_loader(seam: Any) -> None:
    """mlx-vlm's endpoints reach the loader as the package attribute (app._server_package_attr);
    the wrapper there refuses what VlmSeam.check_load refuses. Its own startup calls the
    module's function directly and is not wrapped."""
    package = importlib.import_module("mlx_vlm.server")
    load = package.get_cached_model

    @functools.wraps(load)
    def guarded(model_path: Any, *args: Any, **kwargs: Any):
        inherit = importlib.import_module("mlx_vlm.server.app")._INHERIT_ADAPTER
        adapter_path = args[0] if args else kwargs.get("adapter_path", inherit)
        seam.check_load(model_path, adapter_path, kwargs.get("model_kind", "auto"))
        return load(model_path, *args, **kwargs)

    package.get_cached_model = guarded


def tenant_of(salt: str) -> str:
    """The mlx-vlm tenant a salt's requests run as (its APC partition)."""
    return f"hetero-{salt}"


class SeamGate:
    """ASGI middleware outside mlx-vlm's own (its CORSMiddleware approves every origin).

    Every request is first admitted: signed when the seam has a secret (access.py; the header
    and clock before the body is read, then the signature over the body), its body at most
    --max-body-mb (413) and never chunked (411); a refusal before the body is read closes the
    connection (the body stays unread). A completion body's tenant salt is taken out
    and becomes mlx-vlm's own tenant header (a caller's tenant headers are dropped: what
    changes a call travels in its signed body); bodies that would crash the decoder are refused
    (checks.check_vlm_body); no completion reaches a generation thread that has died (503
    generation_dead, where mlx-vlm would wait forever), and mlx-vlm serves it inside a hang-up
    watch (vlm_cancel.watched).

    /hetero/ requests reach the app without their Origin header, so no CORS header is added to
    a seam reply and no preflight is approved (OPTIONS gets a 405 here); access-control headers
    are taken off seam replies besides. Unloading the model (/unload) and changing its settings
    (which reloads it on the next request) are refused: the seam's decoder keeps its model.
    """

    REFUSED = {("POST", "/unload"), ("PATCH", "/v1/settings"), ("PATCH", "/settings")}

    def __init__(self, app: Any, seam: Any):
        self.app = app
        self.seam = seam

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope.get("method", "")
        try:
            body = await self._admit(scope, receive)
            if body is None:
                return  # the caller left before its body came
            if (method, path) in self.REFUSED:
                message = f"{method} {path} is refused: this decoder keeps serving its model"
                raise SeamError(403, "refused_by_seam", message)
            if not path.startswith(PREFIX):
                scope, body = self._for_decoder(scope, body)
        except SeamError as e:
            return await send_error(send, e, [(k.encode(), v.encode()) for k, v in
                                               e.headers.items()])
        if not path.startswith(PREFIX):
            with self.seam.admissions.admitted():
                # A caller that hangs up stops its generations (vlm_cancel.py).
                return await watched(self.app, scope, body, receive, send, self.seam.liveness)
        receive = _replay(body, receive)
        if method == "OPTIONS":
            error = SeamError(405, "method_not_allowed", "the seam answers no CORS preflight")
            return await send_error(send, error, [(b"allow", b"GET, POST")])
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"origin"]
        scope = dict(scope, headers=headers)

        async def send_without_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                kept = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if not k.lower().startswith(b"access-control-")
                ]
                message = dict(message, headers=kept)
            await send(message)

        await self.app(scope, receive, send_without_cors)

    async def _admit(self, scope: dict, receive: Callable) -> Optional[bytes]:
        """The request's whole body once it may be served (auth.md's order); None when the
        caller disconnected first."""
        headers = _Headers(scope)
        auth, creds = self.seam.auth, None
        try:
            if auth is not None:
                creds = auth.check_header(headers.get("Authorization"))
            n_bytes = body_length(headers, self.seam.max_body_bytes)
        except SeamError as e:
            e.headers["Connection"] = "close"  # the body stays unread on the connection
            raise
        data = bytearray()  # appended in place: a body comes in many pieces
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            data += message.get("body", b"")
            if len(data) > n_bytes:
                raise bad_request("bad_length", "the body is longer than its Content-Length")
            if not message.get("more_body", False):
                break
        body = bytes(data)
        if creds is not None:
            target = scope.get("raw_path") or scope.get("path", "").encode()
            query = scope.get("query_string") or b""
            target = target.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
            auth.check_body(creds, scope.get("method", ""), target, body)
        return body

    def _for_decoder(self, scope: dict, body: bytes) -> tuple:
        """mlx-vlm's own paths: the salt out of the body and into mlx-vlm's tenant header, no
        caller's tenant or Authorization header, and no request for a dead generation thread."""
        drop = TENANT_HEADERS + ((b"authorization",) if self.seam.auth is not None else ())
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in drop]
        if scope.get("method") == "POST" and not self.seam.generation_alive():
            raise SeamError(
                503, "generation_dead", "the decoder's generation thread has died; restart it"
            )
        # JSON bodies (nesting bounded); others (forms, audio) go to mlx-vlm as they came.
        parsed = loads_bounded(body) if body.lstrip()[:1] in (b"{", b"[") else None
        if isinstance(parsed, dict) and self.seam.desc:
            check_vlm_body(parsed, self.seam.desc["vocab_size"])  # checks.py
        if isinstance(parsed, dict) and SALT_FIELD in parsed:
            salt = take_salt(parsed)
            body = json.dumps(parsed).encode()
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            headers.append((b"x-apc-tenant", tenant_of(salt).encode()))
        return dict(scope, headers=headers), body


class _Headers:
    """An ASGI scope's headers as bounds.body_length and RequestAuth read them."""

    def __init__(self, scope: dict):
        self._items = [(k.decode("latin-1").lower(), v.decode("latin-1"))
                       for k, v in scope.get("headers", [])]

    def get(self, name: str, default: Any = None) -> Any:
        values = self.get_all(name)
        return values[0] if values else default

    def get_all(self, name: str) -> List[str]:
        return [v for k, v in self._items if k == name.lower()]


def _replay(body: bytes, receive: Callable) -> Callable:
    """A receive() that gives the app the body already read, then the connection's own
    messages (so mlx-vlm still sees a disconnect)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def send_error(send: Callable, error: SeamError, headers: Optional[list] = None) -> None:
    data = json.dumps(error.body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    head += headers or []
    await send({"type": "http.response.start", "status": error.status, "headers": head})
    await send({"type": "http.response.body", "body": data})
