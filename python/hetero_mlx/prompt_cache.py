"""mlx-lm's LRUPromptCache with one lock, so seam handlers can share it with the generator,
and with the seam's pins (pins.py) honoured at the generator's lookups.

The server's generation thread is the cache's only user in stock mlx-lm, so the class has
no locking. The seam reads and inserts from HTTP handler threads; every public method here
takes one re-entrant lock, and seam endpoints hold the same lock around multi-step work.

MLX streams belong to the thread that made them: a lazy array built on the generation
thread cannot be evaluated on a handler thread ("There is no Stream(cpu, 0) in current
thread"). mlx-lm inserts caches that are still lazy (BatchKVCache.extract), so insert_cache
evaluates them first, on the inserting thread; every cached array is then readable anywhere.

fetch_nearest_cache is the generator's lookup for a request: a pinned prefix of those tokens is
put back if it was evicted, and its pin released. The seam's own reads (cache dumps) use
peek_nearest_cache, which leaves pins alone.

Partitions (tenants.py): the generator's lookups and inserts name only mlx-lm's model key; the
cache turns it into the request's partition key (Tenants.lookup_key, insert_key), and drops an
insert that no single partition, or an older epoch, claims. The seam's own calls (mount,
reuse_length, peek, evict) pass the partition key themselves.
"""

import threading
from typing import Any, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from .pins import Pins
from .tenants import Tenants


def _materialize(prompt_cache: List[Any]) -> None:
    arrays = [a for _, a in tree_flatten([c.state for c in prompt_cache])]
    mx.eval([a for a in arrays if isinstance(a, mx.array)])


class LockedPromptCache(LRUPromptCache):
    def __init__(
        self, *args: Any, pins: Optional[Pins] = None, tenants: Optional[Tenants] = None,
        **kwargs: Any
    ):
        super().__init__(*args, **kwargs)
        self.lock = threading.RLock()
        self.pins = pins if pins is not None else Pins()
        self.tenants = tenants if tenants is not None else Tenants()

    def __len__(self) -> int:
        with self.lock:
            return super().__len__()

    def stats_unlocked(self):
        """(sequences, bytes), read without the lock: for /hetero/info, which must answer while
        the generation thread holds the lock (the values may be a moment old)."""
        return super().__len__(), super().nbytes

    @property
    def nbytes(self) -> int:
        with self.lock:
            return super().nbytes

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        with self.lock:
            model = self.tenants.lookup_key(model, tokens)
            fault = self.pins.take_fault()
            if fault == "kill-generation":  # a test's dead generation thread (pins.py)
                raise RuntimeError("test fault: the generation thread dies here")
            if fault:  # a test's eviction, right before the lookup (pins.py)
                super().trim_to(n_sequences=0)
                if fault == "drop-mount":
                    self.pins.clear()
            for pin in self.pins.take_matching(tokens, lambda p: p.payload[0] == model):
                pinned_model, cache = pin.payload
                if self._trie.search(pinned_model, list(pin.prefix)).exact is None:
                    # Evicted since the mount: put it back (already materialized).
                    super().insert_cache(pinned_model, list(pin.prefix), cache, cache_type="user")
            return super().fetch_nearest_cache(model, tokens)

    def peek_nearest_cache(self, model: Any, tokens: List[int]):
        """fetch_nearest_cache for the seam's own reads: pins stay as they are."""
        with self.lock:
            return super().fetch_nearest_cache(model, tokens)

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], **kwargs: Any):
        """The generator's insert: into the partition tenants.py finds for it, or nowhere."""
        _materialize(prompt_cache)
        with self.lock:
            key = self.tenants.insert_key(model, tokens, kwargs.get("cache_type", "assistant"))
            if key is not None:
                super().insert_cache(key, tokens, prompt_cache, **kwargs)

    def insert_into(self, key: Any, tokens: List[int], prompt_cache: List[Any], epoch: int,
                    **kwargs: Any) -> bool:
        """The seam's insert (a mount) into partition `key`; False, and nothing inserted, when
        the cache was cleared since `epoch` (the mount was asked before the clear)."""
        _materialize(prompt_cache)
        with self.lock:
            if epoch != self.tenants.epoch:
                return False
            super().insert_cache(key, tokens, prompt_cache, **kwargs)
            return True

    def clear(self) -> int:
        """Empties every partition and starts a new epoch (tenants.py); returns the entries
        dropped."""
        with self.lock:
            n = len(self)
            super().trim_to(n_sequences=0)
            self.pins.clear()
            self.tenants.clear()
            return n

    def trim_to(self, **kwargs: Any):
        with self.lock:
            return super().trim_to(**kwargs)

    def evict(self, model: Any, tokens: List[int]) -> bool:
        """Removes the entry of exactly these tokens, if held (a mount the bridge could not
        confirm). The same bookkeeping as LRUPromptCache's own eviction in trim_to."""
        with self.lock:
            if self._trie.search(model, tokens).exact is None:
                return False
            entry = self._trie.pop(model, tokens)
            self._lru.remove(model, tokens)
            self._n_bytes -= entry.nbytes
            self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
            return True

    def stats_by_type(self):
        with self.lock:
            return super().stats_by_type()

    def reuse_length(self, model: Any, tokens: List[int]) -> int:
        """How many leading tokens fetch_nearest_cache(model, tokens) would reuse.

        The same decision as LRUPromptCache.fetch_nearest_cache, without its deep copy of
        the matched cache (gigabytes for long prompts) and without changing anything.
        tests/py/test_seam.py checks it against the server's reported cached_tokens.
        """
        with self.lock:
            result = self._trie.search(model, tokens)
            if result.exact is not None:
                return len(tokens)
            shorter = len(result.shorter) if result.shorter is not None else 0
            if result.longer is not None and result.common_prefix > shorter:
                entry = self._trie.get(result.model, result.longer)
                if can_trim_prompt_cache(entry.prompt_cache):
                    return min(len(tokens) - 1, result.common_prefix)
            return shorter
