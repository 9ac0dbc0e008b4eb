"""Tenants' partitions of mlx-lm's prompt cache, and the epoch that /hetero/clear starts.

A request may carry `"hetero_cache_salt": "<1 to 64 lowercase hex digits>"` (docs/design/auth.md,
"Tenants": the front door derives it from the caller's API key). Every prompt-cache operation
for that request then happens in the salt's own partition, so `cached_tokens` counts only the
caller's own earlier prompts. The partition is the prompt cache's model key: mlx-lm's
LRUPromptCache keys its trie by model, and the seam turns `model_key` into
`(model_key, salt)`; no salt keeps `model_key` itself, exactly as before.

mlx-lm's generation thread looks up and inserts with `model_key` and the tokens only; the
request's identity never reaches the cache. The seam recovers it:

  - its generate() (cancel.py) puts a RequestTag (salt, epoch) on the request's
    GenerationArguments; the generator's `_tokenize`, wrapped, notes the tag of the request it
    tokenizes, and the lookup that always follows it (batch path and _serve_single) takes that
    tag, records the looked-up tokens on it and keeps it among the requests in flight;
  - the request's final insert (prompt + generated tokens) comes right after the generation
    thread puts None on the request's own response queue, a seam queue that names the tag
    (`finishing`): that insert goes to the tag's partition, and the tag is retired;
  - any other insert (a segment's end: the system prompt, the user turn) goes to the partition
    of the in-flight requests whose prompt it is a prefix of, or that are a prefix of it; when
    those belong to two partitions, or to none, the insert is dropped. A dropped insert costs
    only speed; a wrong partition would leak a prompt.

Epochs: /hetero/clear empties the cache and starts a new epoch; an insert computed for a request
admitted in an earlier epoch (a generation in flight during the clear) is dropped, so nothing
from before the clear enters the cache after it.
"""

import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .errors import bad_request

log = logging.getLogger("hetero_mlx")

SALT_FIELD = "hetero_cache_salt"
_SALT = re.compile(r"[0-9a-f]{1,64}")
MAX_IN_FLIGHT = 4096


def take_salt(body: Dict[str, Any]) -> str:
    """Removes the request's salt from its body (the decoder never sees it): "" when absent;
    400 bad_cache_salt unless it is 1 to 64 lowercase hex digits."""
    if SALT_FIELD not in body:
        return ""
    salt = body.pop(SALT_FIELD)
    if not isinstance(salt, str) or not _SALT.fullmatch(salt):
        raise bad_request(
            "bad_cache_salt", f"{SALT_FIELD} must be 1 to 64 lowercase hex digits"
        )
    return salt


def partition(model_key: Any, salt: str) -> Any:
    """The prompt cache's key for the salt's partition (no salt: the model key itself)."""
    return (model_key, salt) if salt else model_key


@dataclass(eq=False)
class RequestTag:
    """One request's partition and admission epoch; `prompt` once the generator looked it up."""

    salt: str
    epoch: int
    prompt: Optional[tuple] = field(default=None, repr=False)


class Tenants:
    """The requests in flight (by tag) and the epoch. The generation-thread hooks (tokenized,
    lookup_key, finishing, insert_key) run on mlx-lm's generation thread only; insert_key and
    clear run under the prompt cache's lock."""

    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT):
        self.epoch = 0
        self.dropped = 0  # inserts dropped: no partition, two partitions, or an older epoch
        self.generation_thread: Optional[threading.Thread] = None
        self._max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._in_flight: "OrderedDict[int, RequestTag]" = OrderedDict()
        self._pending: Optional[RequestTag] = None
        self._finishing: Optional[RequestTag] = None

    def attach(self, generator: Any) -> None:
        """Wraps the server generator's _tokenize (on the instance) so that the lookup after it
        knows its request; the hooks then act on that generator's thread only (the seam's
        tokenize dry runs call the same _tokenize on handler threads)."""
        tokenize = generator._tokenize

        def tokenize_and_note(tokenizer: Any, request: Any, args: Any) -> Any:
            result = tokenize(tokenizer, request, args)
            self.tokenized(args)
            return result

        generator._tokenize = tokenize_and_note
        self.generation_thread = generator._generation_thread

    def tag(self, salt: str) -> RequestTag:
        return RequestTag(salt, self.epoch)

    def retire(self, tag: RequestTag) -> None:
        with self._lock:
            self._in_flight.pop(id(tag), None)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def clear(self) -> None:
        """A new epoch (under the prompt cache's lock, with the cache emptied)."""
        self.epoch += 1

    # ---- generation-thread hooks --------------------------------------------------------

    def _on_generation_thread(self) -> bool:
        return threading.current_thread() is self.generation_thread

    def tokenized(self, args: Any) -> None:
        """The generator tokenized the request of `args`; its lookup comes next."""
        if self._on_generation_thread():
            tag = getattr(args, "hetero_tag", None)
            self._pending = tag if isinstance(tag, RequestTag) else RequestTag("", self.epoch)

    def lookup_key(self, model_key: Any, tokens: Sequence[int]) -> Any:
        """The key of the generator's lookup: the partition of the request just tokenized."""
        tag, self._pending = self._pending, None
        if tag is None or not self._on_generation_thread():
            return model_key
        tag.prompt = tuple(tokens)
        with self._lock:
            self._in_flight[id(tag)] = tag
            while len(self._in_flight) > self._max_in_flight:
                self._in_flight.popitem(last=False)  # its later inserts are dropped
        return partition(model_key, tag.salt)

    def finishing(self, tag: RequestTag) -> None:
        """The generation thread ended the request of `tag` (None on its queue): the next
        "assistant" insert is its final one."""
        if self._on_generation_thread():
            self._finishing = tag

    def insert_key(self, model_key: Any, tokens: List[int], cache_type: str) -> Optional[Any]:
        """The partition a generator insert of `tokens` goes to, or None: dropped."""
        tokens_t = tuple(tokens)
        tag, self._finishing = self._finishing, None
        if cache_type == "assistant" and tag is not None:
            self.retire(tag)
            tags = [tag] if tag.prompt is not None and _related(tag.prompt, tokens_t) else []
        else:
            with self._lock:
                tags = [t for t in self._in_flight.values() if _related(t.prompt, tokens_t)]
        salts = {t.salt for t in tags}
        if len(salts) != 1 or any(t.epoch != self.epoch for t in tags):
            self.dropped += 1
            log.info(
                "prompt cache: dropped an insert of %d tokens (%s)", len(tokens_t),
                "older epoch" if len(salts) == 1 else f"{len(salts)} partitions match",
            )
            return None
        return partition(model_key, salts.pop())


def _related(prompt: Optional[tuple], tokens: tuple) -> bool:
    """Whether one of the two is a prefix of the other."""
    if prompt is None:
        return False
    n = min(len(prompt), len(tokens))
    return prompt[:n] == tokens[:n]
