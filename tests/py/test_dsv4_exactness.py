"""Same-input exactness of the DeepSeek-V4 cache program against the decoder's native cache.

The decoder (mlx-vlm's deepseek_v4) prefills random ids in a given call schedule while every
layer's attention input is recorded; `hetero program` gets those inputs (fed in a different
chunking) plus the schedule, and every array it writes must equal the decoder's own cache bit
for bit: the window in slot order with its _idx, each compressor's pooled rows and buffers, the
indexer's. The schedules cover the decoder's chunk-dependent overlap rule: its own server
schedule (2048-token chunks, the last token alone), single-token calls, calls of 2..8 tokens
(which the decoder runs token by token) and uneven chunks. Each decoder variant of the test
checkpoint runs, including quantized projections.

Needs HETERO_DSV4_MODEL (models/dsv4-tiny, from `make tiny-dsv4`) and the hetero binary.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

SLOW_T = 5003
SERVER_STEP = 2048
VARIANTS = [v for v in os.environ.get("HETERO_DSV4_VARIANTS", "native,mxfp4").split(",") if v]


def _server_calls(n: int) -> List[int]:
    calls = [min(SERVER_STEP, n - 1 - p) for p in range(0, n - 1, SERVER_STEP)]
    return calls + [1]


def _cover(pattern: List[int], total: int) -> List[int]:
    out, i = [], 0
    while sum(out) < total:
        out.append(min(pattern[i % len(pattern)], total - sum(out)))
        i += 1
    return out


# (T, decoder calls pattern or "server", prefill feed chunks)
CASES = [
    (1, "server", "7"),
    (3, "server", "2"),
    (4, "1", "3"),
    (5, "2,3", "64"),
    (127, "server", "50"),
    (128, "100,1", "128"),
    (129, "server", "37"),
    (300, "5,7,1,200", "64"),
    (700, "9,8,1,3,250", "300"),
    (2047, "server", "512"),
    (2048, "1000", "700"),
    (2049, "server", "2048"),
    (SLOW_T, "server", "1000"),
]


# Variants beyond the first run a subset: quantized forwards are slow on MLX's CPU backend, and
# the program's quantized-projection arithmetic is already covered by these.
SUBSET_T = {5, 129}


def _params():
    for i, variant in enumerate(VARIANTS):
        for T, calls, chunks in CASES:
            if i > 0 and T not in SUBSET_T:
                continue
            marks = [pytest.mark.slow] if T == SLOW_T else []
            yield pytest.param(variant, T, calls, chunks, marks=marks, id=f"{variant}-T{T}-{calls}")


@pytest.fixture(scope="module")
def dsv4_root() -> Path:
    path = os.environ.get("HETERO_DSV4_MODEL")
    if not path:
        pytest.skip("HETERO_DSV4_MODEL is not set (models/dsv4-tiny, from make tiny-dsv4)")
    return Path(path)


_loaded: Dict[str, object] = {}


def _decoder(root: Path, variant: str, tmp_root: Path):
    """(model, export dir) for one variant, loaded and exported once per test module."""
    key = str(root / variant)
    if key not in _loaded:
        from mlx_vlm.utils import load_model

        from hetero_mlx.export import export

        path = root / variant
        if not (path / "config.json").exists():
            pytest.fail(f"{path} has no config.json: run make tiny-dsv4")
        out = tmp_root / f"export-{variant}"
        export(str(path), out)
        _loaded[key] = (load_model(path), out)
    return _loaded[key]


def _bits(a) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


@pytest.mark.parametrize("variant,T,calls,chunks", list(_params()))
def test_program_equals_native_cache(
    dsv4_root, hetero_bin, tmp_path_factory, variant, T, calls, chunks
):
    _check_case(dsv4_root, variant, hetero_bin, tmp_path_factory, T, calls, chunks)


@pytest.fixture(scope="module")
def x32_root(tokenizer_dir, tmp_path_factory) -> Path:
    """The test checkpoint at the 2,097,152-token context (YaRN factor 32), decoder variant
    `native` (the one the served decoder runs)."""
    out = tmp_path_factory.mktemp("dsv4-x32")
    run = subprocess.run(
        [sys.executable, "-m", "hetero_mlx", "tiny-dsv4", "--tokenizer", str(tokenizer_dir), "--out",
         str(out), "--variants", "native", "--yarn-factor", "32"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return out


@pytest.mark.parametrize("T,calls,chunks", [(129, "server", "37"), (2049, "server", "2048")])
def test_program_equals_native_cache_at_the_x32_context(
    x32_root, hetero_bin, tmp_path_factory, T, calls, chunks
):
    config = json.loads((x32_root / "native" / "config.json").read_text())
    assert config["max_position_embeddings"] == 2097152, config["max_position_embeddings"]
    assert config["rope_scaling"]["factor"] == 32, config["rope_scaling"]
    _check_case(x32_root, "native", hetero_bin, tmp_path_factory, T, calls, chunks)


def _check_case(root: Path, variant: str, hetero_bin, tmp_path_factory, T: int, calls: str,
                chunks: str) -> None:
    from hetero_mlx import dsv4

    model, export_dir = _decoder(root, variant, tmp_path_factory.mktemp("dsv4"))
    vocab = dsv4.describe(model)["vocab_size"]
    ids = [int(v) for v in np.random.default_rng(T).integers(0, vocab, T)]
    schedule = _server_calls(T) if calls == "server" else _cover(
        [int(c) for c in calls.split(",")], T
    )
    cache, xs, _ = dsv4.run_with_schedule(model, ids, schedule)
    native, window_idx = dsv4.cache_arrays(cache, T)

    work = tmp_path_factory.mktemp("case")
    mx.save_safetensors(str(work / "x.safetensors"), xs)
    out = work / "ours.safetensors"
    run = subprocess.run(
        [str(hetero_bin), "program", "--weights", str(export_dir), "--inputs",
         str(work / "x.safetensors"), "--calls", ",".join(map(str, schedule)),
         "--chunks", chunks, "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    ours, meta = mx.load(str(out), return_metadata=True)
    assert int(meta["window_idx"]) == window_idx
    assert sorted(ours) == sorted(native)
    differing = {}
    for name, want in native.items():
        got = ours[name]
        assert tuple(got.shape) == tuple(want.shape), name
        assert got.dtype == want.dtype, name
        n = int((_bits(got) != _bits(want)).sum())
        if n:
            differing[name] = n
    assert not differing, f"arrays differ (elements): {json.dumps(differing)}"
    # The case must exercise what it claims to: pooled rows exist once T covers a window.
    if T >= 128:
        assert any(a.shape[1] > 0 for k, a in native.items() if k.endswith("pooled"))
