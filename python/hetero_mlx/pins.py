"""Pins: a mounted entry held from the mount until the decoder has looked it up.

Between the seam's mount and the decoder's own lookup for the same request, the decoder may
evict the entry (its prompt cache is an LRU with a size and a byte budget, and other requests
insert into it). A pin keeps the mounted cache objects alive and, at the decoder's next lookup
of ids that start with the pinned prefix, puts the entry back if it is gone; the pin is then
released. The front door also releases a pin once the decoder has answered (POST
/hetero/unpin), and a pin nobody releases expires after `ttl_s`. When the front door's check
after a mount fails (the decoder would not reuse what was mounted), it releases the pin with
"evict": true, and the mounted entry leaves the decoder's cache: a cache the bridge could not
confirm is never served later.

What stays unpredictable is confirmed afterwards, not here: the front door compares the
decoder's own usage (cached_tokens) with what was mounted.

Test faults (only with `serve --test-faults`): POST /hetero/fault {"kind": K} arms a one-shot
fault that strikes right before the decoder's next lookup:
  evict       every cached entry is evicted, pins kept: a pinned mount must come back;
  drop-mount  every cached entry and every pin are dropped, as if the decoder had lost the
              mounted prefix anyway: the request re-prefills, and its verdict must say so.
"""

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from .errors import SeamError, bad_request

# evict: the cache emptied right before the next lookup; drop-mount: its pins too;
# kill-generation: the next lookup raises on the generation thread, which dies of it as it did
# of a `stop` of [1] (issue 50, finding 1): a dead decoder for hetero up to restart.
FAULT_KINDS = ("evict", "drop-mount", "kill-generation")


@dataclass
class Pin:
    prefix: tuple  # the mounted ids[:B]
    payload: Any  # what the family needs to put the entry back (its cache objects, keys)
    expires: float  # time.monotonic() deadline


class Pins:
    def __init__(self, ttl_s: float = 600.0, faults_enabled: bool = False):
        self._lock = threading.Lock()
        self._pins: dict = {}
        self._ttl_s = ttl_s
        self._faults_enabled = faults_enabled
        self._armed: Optional[str] = None

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._pins)

    def add(self, prefix: Sequence[int], payload: Any) -> str:
        pin_id = uuid.uuid4().hex
        with self._lock:
            self._expire()
            self._pins[pin_id] = Pin(tuple(prefix), payload, time.monotonic() + self._ttl_s)
        return pin_id

    def release(self, pin_id: str) -> Optional[Pin]:
        with self._lock:
            return self._pins.pop(pin_id, None)

    def take_matching(
        self, tokens: Sequence[int], where: Optional[Callable[[Pin], bool]] = None
    ) -> List[Pin]:
        """Removes and returns the live pins whose prefix starts `tokens` (a lookup for them),
        of those `where` accepts (a lookup in one partition takes only that partition's pins)."""
        tokens = tuple(tokens)
        with self._lock:
            self._expire()
            hit = [
                k
                for k, p in self._pins.items()
                if tokens[: len(p.prefix)] == p.prefix and (where is None or where(p))
            ]
            return [self._pins.pop(k) for k in hit]

    def clear(self) -> int:
        with self._lock:
            n = len(self._pins)
            self._pins.clear()
            return n

    def arm(self, body: dict) -> dict:
        """POST /hetero/fault: arms a one-shot test fault (only when the seam allows faults)."""
        if not self._faults_enabled:
            raise SeamError(404, "not_found", "test faults are off (serve --test-faults)")
        kind = body.get("kind")
        if kind not in FAULT_KINDS:
            raise bad_request("bad_fault", f"kind must be one of {list(FAULT_KINDS)}")
        with self._lock:
            self._armed = kind
        return {"armed": kind}

    def take_fault(self) -> Optional[str]:
        with self._lock:
            kind, self._armed = self._armed, None
            return kind

    def _expire(self) -> None:
        now = time.monotonic()
        for k in [k for k, p in self._pins.items() if p.expires <= now]:
            del self._pins[k]


def unpin_request(pins: Pins, body: dict, evict: Callable[[Pin], bool]) -> dict:
    """POST /hetero/unpin {"pin", "evict"?}: releases it (idempotent); with "evict": true, also
    removes the pinned prefix's entry from the decoder's cache (evict(pin): whether one was)."""
    pin_id, drop = body.get("pin"), body.get("evict", False)
    if not isinstance(pin_id, str) or not pin_id:
        raise bad_request("bad_pin", "pin must be a non-empty string")
    if not isinstance(drop, bool):
        raise bad_request("bad_evict", "evict must be true or false")
    pin = pins.release(pin_id)
    return {"released": pin is not None, "evicted": bool(pin is not None and drop and evict(pin))}
