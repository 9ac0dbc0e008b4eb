"""A sliding layer's cache past its window, as the seam mounts and reads it.

mlx-lm's own buffer after a multi-token call past the window holds W - 1 rows before the call
plus the call's; the seam mounts only the window's last W rows (llama._window_state), without
knowing the decoder's calls. Every later use must then be the same: a one-token call (the first
decode step), a longer call (a warm turn's prefill), the server's batch cache built from it, and
the seam's own dump. A tail mounted onto the decoder's prefix (extend_cache) must leave what the
decoder's own call over the tail leaves. Checked here on the decoder's own rows, bit for bit.
"""

import copy

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache, make_prompt_cache  # noqa
from mlx_lm.utils import load  # noqa: E402

from hetero_mlx.llama import build_cache, cache_arrays, extend_cache  # noqa: E402
from hetero_mlx.tiny import TinyShape, make_tiny_llama  # noqa: E402

WINDOW = 64
SHAPE = TinyShape("llama", 3, 64, 4, 2, 16, 128, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("sliding") / "model"
    make_tiny_llama(tokenizer_dir, out, 41, SHAPE)
    m, _ = load(str(out))
    return m


def ids_of(model, n, seed):
    return np.random.default_rng(seed).integers(0, model.args.vocab_size, size=n).tolist()


def prefill(model, ids, calls, cache=None):
    """The decoder's forward over ids in these calls; the last call's logits."""
    cache = cache if cache is not None else make_prompt_cache(model)
    pos, logits = 0, None
    for n in calls:
        logits = model(mx.array(ids[pos : pos + n])[None], cache=cache)
        pos += n
    mx.eval(logits, [c.state for c in cache])
    return cache, logits


def bits(a):
    return np.array(a.astype(mx.float32)).view(np.uint32)


def assert_same(got, want, what):
    assert got.shape == want.shape, f"{what}: {got.shape} vs {want.shape}"
    assert np.array_equal(bits(got), bits(want)), f"{what}: differs"


def assert_same_arrays(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert_same(got[k], want[k], k)


def mounted_from(model, native, n):
    """What the seam mounts for the decoder's rows of n tokens: every row of a full layer; for
    the sliding one, the rows the prefill host sends (all n), of which only the last window's
    are the decoder's here: the rest are zeros, and must not matter."""
    held = cache_arrays(native, n)
    arrays = {}
    for k, v in held.items():
        pad = n - v.shape[1]
        arrays[k] = mx.concatenate([mx.zeros((v.shape[0], pad, v.shape[2]), v.dtype), v], 1)
    return build_cache(model, arrays, n)


def test_the_window_alone_is_the_decoders_cache_to_every_later_use(model):
    T = 300
    ids = ids_of(model, T + 8, 1)
    native, _ = prefill(model, ids[:T], [256, 44])  # buffer: 63 rows + the call's 44
    sliding = native[1]
    assert isinstance(sliding, RotatingKVCache) and sliding.keys.shape[2] == WINDOW - 1 + 44
    mounted = mounted_from(model, native, T)
    m = mounted[1]
    assert (m.offset, m.keep, m.max_size, m._idx, m.keys.shape[2]) == (T, 0, WINDOW, WINDOW,
                                                                         WINDOW)
    # The seam's dumps of both: the window, in order.
    assert_same_arrays(cache_arrays(mounted, T), cache_arrays(native, T))
    # The server's batch cache made from either: the same rows, offsets and index.
    a, b = BatchRotatingKVCache.merge([native[1]]), BatchRotatingKVCache.merge([mounted[1]])
    assert_same(a.keys, b.keys, "merged keys")
    assert (a._idx, a._offset, a.offset.tolist()) == (b._idx, b._offset, b.offset.tolist())
    # Decoding on: one token, then one more, then a longer call (a warm turn).
    for calls in ([1, 1, 6], [5, 1]):
        n_cache, m_cache = copy.deepcopy(native), copy.deepcopy(mounted)
        pos = T
        for n in calls:
            step = mx.array(ids[pos : pos + n])[None]
            want, got = model(step, cache=n_cache), model(step, cache=m_cache)
            mx.eval(want, got)
            assert_same(got, want, f"logits at {pos} (+{n}) after calls {calls}")
            pos += n
        assert_same_arrays(cache_arrays(m_cache, pos), cache_arrays(n_cache, pos))


def test_a_tail_mounted_on_the_decoders_prefix_is_its_own_call_over_the_tail(model):
    C, tail = 300, 50
    ids = ids_of(model, C + tail + 1, 2)
    prefix, _ = prefill(model, ids[:C], [256, 44])
    # The decoder's own call over the tail: its rows, and its next step.
    native, _ = prefill(model, ids[C : C + tail], [tail], cache=copy.deepcopy(prefix))
    rows = cache_arrays(native, C + tail)
    arrays = {}
    for k, v in rows.items():  # the tail's rows: the last `tail` of each layer
        arrays[k] = v[:, v.shape[1] - tail :, :]
    extended = extend_cache(copy.deepcopy(prefix), arrays, C + tail)
    assert_same_arrays(cache_arrays(extended, C + tail), rows)
    step = mx.array(ids[C + tail :])[None]
    want, got = model(step, cache=native), model(step, cache=extended)
    mx.eval(want, got)
    assert_same(got, want, "the step after the tail")


def test_a_cache_past_its_window_is_not_cut_back(model):
    ids = ids_of(model, 200, 3)
    native, _ = prefill(model, ids, [200])
    with pytest.raises(ValueError, match="cannot be cut back to 150"):
        cache_arrays(native, 150)
