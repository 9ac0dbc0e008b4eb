"""A completion whose caller hung up stops costing (mlx-vlm): cancel.py's counterpart.

mlx-vlm's non-streaming endpoints run the whole generation in a worker thread
(`asyncio.to_thread`, reading the request's _TokenIterator to its end) and touch the connection
only to send the reply: a caller that hangs up leaves its generation running to max_tokens for
nobody, batched with everybody else's. A streaming endpoint answers with Starlette's
StreamingResponse, which listens for the ASGI disconnect and cancels the body iterator, whose
`finally` closes the token iterator: streaming already stops.

SeamGate (vlm_gate.py) serves each request to mlx-vlm's own paths through `watched`:

  - after SeamGate has read the body, the watch alone reads the connection's receive(); the app
    gets the body and then waits on the watch, which hands it the disconnect. uvicorn says
    http.disconnect when the connection is lost or the response is complete; lost before the
    response's last byte was sent is a hang-up;
  - the watch rides a ContextVar, which asyncio.to_thread and anyio tasks copy into the code
    that calls ResponseGenerator.generate, so SeamResponseGenerator (vlm_tokenize.py) finds it:
    it refuses to queue a generation for a caller already gone (cancel.ClientGone, which
    SeamGate swallows) and registers each generation's token iterator (`track`), counted in
    flight until it ends or is closed (cancel.Liveness, /hetero/info's `requests`);
  - at a hang-up every registered generation still running is closed with mlx-vlm's own
    _TokenIterator.close(): the generation thread removes the request at its next step
    (`Generation cancelled` in mlx-vlm's log) and ends its queue, so the endpoint's worker
    thread returns; the reply it makes goes nowhere. A generation whose context arrives after
    the hang-up is closed as it is registered (its first step has run).
"""

import asyncio
import threading
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional, Set

from .cancel import ClientGone, Liveness

WATCH: ContextVar[Optional["HangUpWatch"]] = ContextVar("hetero_vlm_watch", default=None)


class HangUpWatch:
    """One HTTP request's generations, stopped when its caller hangs up."""

    def __init__(self, liveness: Liveness):
        self.liveness = liveness
        self.gone = False
        self._lock = threading.Lock()
        self._running: Set["Tokens"] = set()

    def check(self) -> None:
        """Before a generation is queued: none for a caller already gone."""
        if self.gone:
            self.liveness.note_hang_up()
            raise ClientGone()

    def track(self, tokens: Any) -> "Tokens":
        """A generation's token iterator, counted in flight; closed at once if the caller left
        while it was being queued."""
        watched = Tokens(tokens, self)
        self.liveness.add(1)
        with self._lock:
            gone = self.gone
            if not gone:
                self._running.add(watched)
        if gone:
            watched.close()
            self.liveness.note_hang_up()
        return watched

    def hang_up(self) -> None:
        with self._lock:
            self.gone = True
            running = list(self._running)
        for tokens in running:
            tokens.close()
            self.liveness.note_hang_up()

    def ended(self, tokens: "Tokens") -> None:
        with self._lock:
            self._running.discard(tokens)


class Tokens:
    """mlx-vlm's _TokenIterator, its end (last token, error or close) noted once."""

    def __init__(self, inner: Any, watch: HangUpWatch):
        self._inner, self._watch = inner, watch
        self._ended = False
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            item = next(self._inner)
        except BaseException:
            self._end()
            raise
        if getattr(item, "finish_reason", None):
            self._end()
        return item

    def close(self) -> None:
        try:
            self._inner.close()  # thread-safe: cancels an unfinished generation
        finally:
            self._end()

    def _end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._watch.ended(self)
        self._watch.liveness.add(-1)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


async def watched(app: Callable, scope: dict, body: bytes, receive: Callable, send: Callable,
                  liveness: Liveness) -> None:
    """Runs `app` on a request whose body SeamGate has read, inside a HangUpWatch (above)."""
    watch = HangUpWatch(liveness)
    disconnected = asyncio.Event()
    complete = False  # the response's last byte has been handed to the server
    body_sent = False

    async def app_receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def app_send(message: dict) -> None:
        nonlocal complete
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            complete = True
        await send(message)

    async def watch_connection() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not complete:
            watch.hang_up()
        disconnected.set()

    watcher = asyncio.ensure_future(watch_connection())
    token = WATCH.set(watch)
    try:
        await app(scope, app_receive, app_send)
    except ClientGone:
        pass  # its caller is gone: nothing to answer
    except BaseExceptionGroup as group:
        # mlx-vlm's @app.middleware("http") (Starlette's BaseHTTPMiddleware) runs the endpoint
        # in a task group: ClientGone comes out grouped, beside its "No response returned."
        if group.subgroup(ClientGone) is None:
            raise
    finally:
        WATCH.reset(token)
        watcher.cancel()
