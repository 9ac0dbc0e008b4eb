"""A completion whose caller hung up stops costing: the seam's own ResponseGenerator.generate.

mlx-lm's handler writes a non-streaming reply only at the end, so it learns that its client
closed the connection only then: the generation runs on to max_tokens for nobody, and the
requests behind it wait. A streaming handler learns at a failed write, one or two tokens (or
prompt-processing keepalives) after the hang-up.

The seam hands each completion handler a RequestGenerator in place of the server's generator.
Its generate() is mlx-lm's (the request queued on the server's generation thread, responses read
from a queue), except that:

  - the response queue is the seam's (ResponseQueue): it notes the request's GenerationContext
    as the generation thread puts it, and tells tenants.py when the generation thread ends the
    request (the None that precedes the request's final prompt-cache insert);
  - while waiting on that queue, every POLL_S it looks at the handler's socket: readable with
    nothing to read (recv MSG_PEEK returns b"") or reset means the caller is gone. It then
    stops the generation (GenerationContext.stop(): mlx-lm's generation thread drops the request
    at its next step, or, for a request not yet started, as soon as it puts the context) and
    raises ClientGone, which ends the handler. It cannot wait for the generation thread's None:
    after stop() mlx-lm's batch path removes the request without putting one;
  - the request's GenerationArguments carry its tenant tag (tenants.RequestTag).
"""

import logging
import select
import socket
import threading
import time
from queue import Empty, Queue
from typing import Any, Callable, Dict, Optional

from mlx_lm.server import GenerationContext

from .tenants import RequestTag, Tenants

log = logging.getLogger("hetero_mlx")

POLL_S = 0.1


class ClientGone(BaseException):
    """The caller closed its connection. A BaseException, so that mlx-lm's handler, which
    answers any Exception from generate() with an error reply, lets it through to the seam."""


def client_gone(sock: socket.socket) -> bool:
    """Whether the peer of `sock` has closed it (or reset it), without consuming any byte."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        events = poller.poll(0)
    except (OSError, ValueError):
        return True
    if not events:
        return False
    if events[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class ResponseQueue(Queue):
    """One request's response queue, filled by mlx-lm's generation thread."""

    def __init__(self, tag: RequestTag, tenants: Tenants):
        super().__init__()
        self.tag, self._tenants = tag, tenants
        self._ctx: Optional[GenerationContext] = None
        self._cancelled = False
        self._cancel_lock = threading.Lock()

    def put(self, item: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        if isinstance(item, GenerationContext):
            with self._cancel_lock:
                self._ctx = item
                if self._cancelled:  # its caller left before it started
                    item.stop()
        elif item is None:
            self._tenants.finishing(self.tag)
        super().put(item, block, timeout)

    def cancel(self) -> None:
        with self._cancel_lock:
            self._cancelled = True
            if self._ctx is not None:
                self._ctx.stop()


class Liveness:
    """Counts for /hetero/info: requests in flight through the seam, and those whose caller
    hung up (their generation stopped)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0
        self.hung_up = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.in_flight += n

    def note_hang_up(self) -> None:
        with self._lock:
            self.hung_up += 1

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return {"in_flight": self.in_flight, "stopped_on_hang_up": self.hung_up}


class RequestGenerator:
    """Stands in for the server's ResponseGenerator in one completion handler (see above);
    every other attribute is the server generator's."""

    def __init__(self, generator: Any, sock: socket.socket, tag: RequestTag, tenants: Tenants,
                 liveness: Liveness):
        self._generator, self._sock, self._tag = generator, sock, tag
        self._tenants, self._liveness = tenants, liveness
        self._next_check = 0.0
        self._queue: Optional[ResponseQueue] = None
        self._ended = True  # until a request is queued

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    def generate(self, request: Any, generation_args: Any,
                 progress_callback: Optional[Callable[[int, int], None]] = None):
        generator = self._generator
        if not generator.generation_available():
            raise RuntimeError("generation thread died")
        generation_args.hetero_tag = self._tag
        queue = self._queue = ResponseQueue(self._tag, self._tenants)
        self._ended = False
        self._liveness.add(1)
        generator.requests.put((queue, request, generation_args))
        try:
            ctx = self._await(queue)
            if isinstance(ctx, Exception):
                raise ctx
        except BaseException:
            self._end()
            raise
        return ctx, self._responses(queue, progress_callback)

    def _responses(self, queue: ResponseQueue, progress_callback: Any):
        n_tokens = 0
        try:
            while True:
                response = self._await(queue, n_tokens)
                if response is None:
                    break
                if isinstance(response, Exception):
                    raise response
                if isinstance(response, tuple):
                    if progress_callback is not None:
                        progress_callback(*response)
                    continue
                n_tokens += 1
                yield response
        finally:
            self._end()

    def _await(self, queue: ResponseQueue, n_tokens: int = 0) -> Any:
        """The next response; the caller's socket looked at every POLL_S meanwhile."""
        while True:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + POLL_S
                if client_gone(self._sock):
                    queue.cancel()
                    self._liveness.note_hang_up()
                    log.info("the caller hung up: stopped its generation after %d tokens",
                             n_tokens)
                    raise ClientGone()
                if not self._generator.generation_available():
                    raise RuntimeError("generation thread died")
            try:
                return queue.get(timeout=max(0.0, self._next_check - time.monotonic()))
            except Empty:
                pass

    def close(self) -> None:
        """The handler is done: a request it left unread (its reply failed before reading the
        responses) is stopped rather than left generating for nobody."""
        if not self._ended and self._queue is not None:
            self._queue.cancel()
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._tenants.retire(self._tag)
            self._liveness.add(-1)
