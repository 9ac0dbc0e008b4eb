"""Pins on mlx-lm's own prompt cache (prompt_cache.py, pins.py), without a server: a mounted
entry evicted before the generator's lookup is put back by its pin, once; the seam's own reads
leave pins alone; pins expire; faults are refused unless enabled."""

import time

import mlx.core as mx
import pytest
from hetero_mlx.errors import SeamError
from hetero_mlx.pins import Pins, unpin_request
from hetero_mlx.prompt_cache import LockedPromptCache
from mlx_lm.models.cache import KVCache

MODEL = ("model", None, None)  # a model key, as mlx-lm's provider makes them


def kv_cache(n: int, layers: int = 2):
    caches = []
    for i in range(layers):
        c = KVCache()
        k = mx.full((1, 2, n, 4), float(i + 1), dtype=mx.bfloat16)
        c.update_and_fetch(k, -k)
        caches.append(c)
    return caches


def mount(cache: LockedPromptCache, prefix):
    """As the seam's /hetero/mount inserts (insert_into: the generator's own insert_cache keeps
    only caches of requests in flight, tenants.py)."""
    entry = kv_cache(len(prefix))
    with cache.lock:
        assert cache.insert_into(MODEL, list(prefix), entry, cache.tenants.epoch,
                                 cache_type="user")
        return cache.pins.add(prefix, (MODEL, entry))


def reused(cache: LockedPromptCache, tokens) -> int:
    got, rest = cache.fetch_nearest_cache(MODEL, list(tokens))
    return len(tokens) - len(rest) if got is not None else 0


def test_evicted_mount_is_restored_at_the_lookup_then_released() -> None:
    cache = LockedPromptCache(10)
    prefix, prompt = list(range(1, 9)), list(range(1, 10))
    mount(cache, prefix)
    cache.trim_to(n_sequences=0)  # evicted before the decoder looked it up
    assert cache.reuse_length(MODEL, prompt) == 0
    assert reused(cache, prompt) == len(prefix)  # the pin put it back
    assert len(cache.pins) == 0
    cache.trim_to(n_sequences=0)
    assert reused(cache, prompt) == 0  # released: an eviction now is final


def test_seam_reads_and_other_prompts_leave_the_pin() -> None:
    cache = LockedPromptCache(10)
    prefix = list(range(1, 9))
    mount(cache, prefix)
    cache.peek_nearest_cache(MODEL, prefix + [0])
    assert reused(cache, [7, 7, 7]) == 0  # another prompt: not this pin's lookup
    assert len(cache.pins) == 1


def test_pins_expire_and_unpin_is_idempotent() -> None:
    pins = Pins(ttl_s=0.05)
    a = pins.add([1, 2], None)
    assert pins.release(a) and not pins.release(a)
    pins.add([1, 2], None)
    time.sleep(0.1)
    assert len(pins) == 0 and pins.take_matching([1, 2, 3]) == []


def test_unpin_with_evict_removes_exactly_the_mounted_entry() -> None:
    cache = LockedPromptCache(10)
    other = list(range(20, 30))
    assert cache.insert_into(MODEL, other, kv_cache(len(other)), cache.tenants.epoch,
                             cache_type="assistant")
    prefix = list(range(1, 9))
    pin = mount(cache, prefix)
    nbytes = cache.nbytes

    def evict(p):
        return cache.evict(p.payload[0], list(p.prefix))

    assert unpin_request(cache.pins, {"pin": pin, "evict": True}, evict) == {
        "released": True, "evicted": True}
    assert cache.reuse_length(MODEL, prefix + [0]) == 0 and len(cache) == 1
    assert cache.reuse_length(MODEL, other + [0]) == len(other)
    assert cache.nbytes == nbytes - sum(c.nbytes for c in kv_cache(len(prefix)))
    assert cache.stats_by_type()["user"] == {"n_sequences": 0, "n_bytes": 0}
    # A plain unpin leaves the entry where it is.
    pin = mount(cache, prefix)
    assert unpin_request(cache.pins, {"pin": pin}, evict) == {"released": True, "evicted": False}
    assert cache.reuse_length(MODEL, prefix + [0]) == len(prefix)


def test_faults_need_the_test_flag() -> None:
    with pytest.raises(SeamError) as e:
        Pins().arm({"kind": "evict"})
    assert e.value.status == 404
    pins = Pins(faults_enabled=True)
    with pytest.raises(SeamError):
        pins.arm({"kind": "no-such-fault"})
    assert pins.arm({"kind": "drop-mount"}) == {"armed": "drop-mount"}
    assert pins.take_fault() == "drop-mount" and pins.take_fault() is None
