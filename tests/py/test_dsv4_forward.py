"""The DeepSeek-V4 CPU prefill forward against the decoder, per layer.

The truth is the decoder itself: mlx-vlm 0.7.10's deepseek_v4 loaded from the tiny checkpoint's
bf16/ conversion with mlx_vlm.utils.load, run on MLX's CPU backend with its own caches and the
same chunk schedule. Each block's attention input is captured by standing a recorder in for the
block's attn_norm module (it calls the original and keeps its output; the decoder's arithmetic is
untouched). Our side is `hetero prefill --model <dir> --ids-file --chunk --out` on the same
checkpoint directory (and on the official fp8/ one).

Tolerance: none. Every layer, T and chunking must be bit-exact (max |diff| 0, no element
differs): the forward follows the decoder's op order and rounding points throughout
(docs/design/prefill-dsv4.md). Four comparisons:
- the engine on the official fp8/ checkpoint with its default arithmetic (`--quant-arith
  mlx-cpu`) against the decoder we serve, native/: mlx-vlm's conversion that keeps the
  checkpoint's own FP8/FP4 codes as mxfp8/mxfp4 and rounds ape to bf16;
- the engine and the decoder on the same dense bf16/ conversion (either profile: bf16/ has no
  quantized matrices and bf16 ape, so both compute the same);
- the engine on fp8/ with `--quant-arith dequant` against the decoder on bf16/ with the
  compressors' `ape` set back to fp8/'s float32 values (the conversion rounds ape to bf16; every
  other weight of bf16/ is fp8/'s exact dequantization);
- the engine on fp8/ told the decoder's calls (`--decoder-calls`) with chunks that span several
  of them, against the decoder on native/ run call by call.

Skips unless HETERO_DSV4_MODEL points at the tiny checkpoint root (with fp8/, bf16/, native/).
Run as a script for the tables: python tests/py/test_dsv4_forward.py [native|bf16|fp8]
[--quant-arith mlx-cpu|dequant] [--official-ape]
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SEED = 20240607
# (T, chunk schedule): one token; 2..8-token chunks (the decoder's token-by-token path); just
# under, at and just over the 128-row window and a ratio-128 window; long prompts cut in several
# places (ratio-4 windows split across calls, one-token calls after the window is full).
CASES = [
    (1, "1"),
    (5, "5"),
    (5, "2,3"),
    (127, "127"),
    (129, "129"),
    (129, "128,1"),
    (129, "3,100,26"),
    (300, "9,130,7,1,153"),
    (600, "600"),
    (600, "250"),
    (600, "64,1,1,5,200"),
    pytest.param(2049, "2048,1", marks=pytest.mark.slow),
    pytest.param(2049, "700,1,9", marks=pytest.mark.slow),
]
# The served decoder (native/) against the engine on fp8/ in its default profile: the same
# awkward sizes, every chunk shape the decoder treats differently (one call, 2..8-token calls,
# one-token calls after a full window, ratio-4 windows split across calls), and past 4096
# tokens, where the decoder's indexer switches to HISA block selection.
NATIVE_CASES = [
    (1, "1"),
    (5, "5"),
    (5, "2,3"),
    (129, "129"),
    (129, "128,1"),
    (129, "3,100,26"),
    (300, "300"),
    (300, "9,130,7,1,153"),
    (600, "600"),
    (600, "250"),
    (600, "64,1,1,5,200"),
    pytest.param(5003, "4100,1,1,5,896", marks=pytest.mark.slow),
]


def _model_root():
    root = os.environ.get("HETERO_DSV4_MODEL")
    if not root:
        pytest.skip("HETERO_DSV4_MODEL is not set (the tiny DeepSeek-V4 checkpoint root)")
    root = Path(root)
    for sub in ("fp8", "bf16", "native"):
        if not (root / sub / "config.json").exists():
            pytest.skip(f"HETERO_DSV4_MODEL={root} has no {sub}/config.json")
    return root


def _ids(T: int, vocab: int) -> list:
    rng = np.random.default_rng(SEED + T)
    return [int(v) for v in rng.integers(0, vocab, size=T)]


def _schedule(spec: str, T: int) -> list:
    sizes = [int(s) for s in spec.split(",")]
    out, done, i = [], 0, 0
    while done < T:
        n = min(sizes[min(i, len(sizes) - 1)], T - done)
        out.append(n)
        done += n
        i += 1
    return out


class _Recorder:
    """Stands in for a block's attn_norm: calls it and keeps the output."""

    def __init__(self, norm, sink):
        self.norm, self.sink = norm, sink

    def __call__(self, x):
        y = self.norm(x)
        self.sink.append(y)
        return y


_DECODER = {}


def _float32_gather_mm():
    """MLX's CPU GatherMM refuses bf16 ("Currently only supports float32"), so the decoder cannot
    run a dense bf16 checkpoint's routed experts on CPU as shipped. The experts run here the way
    mlx-vlm's own offloaded experts do on CPU: gather_mm on float32 copies, cast back to bf16.
    For bf16 inputs that is the bf16 matmul's own recipe (exact products summed in float32, one
    rounding), so it stands in for the missing kernel without changing any other arithmetic."""
    import mlx.core as mx
    from mlx_vlm.models import switch_layers

    def call(self, x, indices, sorted_indices=False):
        out = mx.gather_mm(
            x.astype(mx.float32),
            self["weight"].astype(mx.float32).swapaxes(-1, -2),
            rhs_indices=indices,
            sorted_indices=sorted_indices,
        ).astype(x.dtype)
        if "bias" in self:
            out = out + mx.expand_dims(self["bias"][indices], -2)
        return out

    switch_layers.SwitchLinear.__call__ = call


@pytest.fixture(scope="module", autouse=True)
def _experts_in_float32_here_only():
    """The patch above, for this module's tests only: it replaces a method of mlx-vlm's class
    for the whole process, and another module on the same pytest worker (test_dsv4_checkpoint)
    checks the decoder's behaviour as shipped."""
    from mlx_vlm.models import switch_layers

    shipped = switch_layers.SwitchLinear.__call__
    _float32_gather_mm()
    yield
    switch_layers.SwitchLinear.__call__ = shipped


def _official_apes(fp8: Path) -> dict:
    """{layer: {"compressor": f32 ape, "indexer": f32 ape}} as the official checkpoint stores them."""
    from safetensors import safe_open

    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for key, shard in index.items():
        if key.startswith("layers.") and key.endswith(".compressor.ape"):
            with safe_open(str(fp8 / shard), "numpy") as f:
                layer = int(key.split(".")[1])
                which = "indexer" if ".indexer." in key else "compressor"
                out.setdefault(layer, {})[which] = f.get_tensor(key)
    return out


def _decoder(path: Path, ape_from: Path = None):
    """The decoder on `path`; with ape_from, its compressors' ape replaced by the official
    checkpoint's float32 values (the bf16 conversion rounds them; nothing else differs)."""
    key = (path, ape_from)
    if key not in _DECODER:
        import mlx.core as mx
        from mlx_vlm.utils import load

        mx.set_default_device(mx.cpu)
        _float32_gather_mm()
        model, _ = load(str(path))
        lm = getattr(model, "language_model", model)
        if ape_from is not None:
            for layer, apes in _official_apes(ape_from).items():
                attn = lm.model.layers[layer].attn
                attn.compressor.ape = mx.array(apes["compressor"])
                if "indexer" in apes:
                    attn.indexer.compressor.ape = mx.array(apes["indexer"])
        sinks = []
        for block in lm.model.layers:
            sink = []
            block.attn_norm = _Recorder(block.attn_norm, sink)
            sinks.append(sink)
        _DECODER[key] = (lm, sinks)
    return _DECODER[key]


def decoder_attention_inputs(path: Path, ids: list, schedule: list, ape_from: Path = None) -> list:
    """Per layer, the decoder's attention inputs [T, hidden] as float32 numpy arrays."""
    import mlx.core as mx

    lm, sinks = _decoder(path, ape_from)
    for s in sinks:
        s.clear()
    cache = lm.make_cache()
    done = 0
    for n in schedule:
        out = lm(mx.array([ids[done : done + n]]), cache=cache)
        mx.eval(out.logits, [s[-1] for s in sinks])
        done += n
    return [np.array(mx.concatenate(s, axis=1)[0].astype(mx.float32)) for s in sinks]


def engine_attention_inputs(hetero: Path, model: Path, ids: list, spec: str,
                            quant_arith: str = "mlx-cpu", decoder_calls: str = "") -> list:
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        out = Path(tmp) / "out"
        subprocess.run(
            [str(hetero), "prefill", "--model", str(model), "--ids-file", str(ids_file),
             "--chunk", spec, "--quant-arith", quant_arith, "--out", str(out)]
            + (["--decoder-calls", decoder_calls] if decoder_calls else []),
            check=True, capture_output=True, text=True,
        )
        info = json.loads((out / "prefill.json").read_text())
        assert info["T"] == len(ids) and sum(info["schedule"]) == len(ids)
        arrays = mx.load(str(out / "attention_inputs.safetensors"))
        return [np.array(arrays[f"layers.{i}.x"].astype(mx.float32)) for i in range(len(arrays))]


def gaps(ours: list, theirs: list) -> list:
    """Per layer (max |diff|, fraction of differing elements)."""
    rows = []
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape, (a.shape, b.shape)
        assert np.array_equal(np.isnan(a), np.isnan(b))
        d = np.abs(a - b)
        rows.append((float(d.max()), float((a != b).mean())))
    return rows


def _vocab(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("T,spec", CASES)
def test_bf16_checkpoint_is_bit_exact(hetero_bin, T, spec):
    root = _model_root()
    ids = _ids(T, _vocab(root / "bf16"))
    theirs = decoder_attention_inputs(root / "bf16", ids, _schedule(spec, T))
    ours = engine_attention_inputs(hetero_bin, root / "bf16", ids, spec, quant_arith="dequant")
    assert len(ours) == len(theirs)
    for layer, (mx_diff, frac) in enumerate(gaps(ours, theirs)):
        assert mx_diff == 0.0 and frac == 0.0, (
            f"T={T} chunks={spec} layer {layer}: max|diff| {mx_diff}, {frac:.2%} differ"
        )


@pytest.mark.parametrize("T,spec", NATIVE_CASES)
def test_fp8_checkpoint_matches_native_decoder(hetero_bin, T, spec):
    """The decoder we serve (native/: FP8 projections as mxfp8, FP4 experts as mxfp4, bf16 ape)
    against the engine on the official fp8/ checkpoint in its default arithmetic, which runs
    every quantized projection with MLX's CPU quantized-matmul recipe (bf16 accumulation per
    32-group, docs/findings/dsv4-mlx-numerics.md) and rounds ape to bf16."""
    root = _model_root()
    ids = _ids(T, _vocab(root / "fp8"))
    theirs = decoder_attention_inputs(root / "native", ids, _schedule(spec, T))
    ours = engine_attention_inputs(hetero_bin, root / "fp8", ids, spec)
    assert len(ours) == len(theirs)
    for layer, (mx_diff, frac) in enumerate(gaps(ours, theirs)):
        assert mx_diff == 0.0 and frac == 0.0, (
            f"T={T} chunks={spec} layer {layer}: max|diff| {mx_diff}, {frac:.2%} differ"
        )


# (T, the decoder's calls, the engine's chunks): one engine chunk spanning several decoder calls,
# told where they were cut (--decoder-calls), as the served host groups them; every chunk edge on
# a call edge, the spanned calls including 2..8-token ones that run token by token.
SPANNING_CASES = [
    (129, "3,100,26", "129"),
    (300, "9,130,7,1,153", "300"),
    (300, "9,130,7,1,153", "146,154"),
    (600, "250", "600"),
    (600, "64,1,1,5,200", "71,529"),
]


@pytest.mark.parametrize("T,calls,spec", SPANNING_CASES)
def test_chunks_spanning_decoder_calls_match_native_decoder(hetero_bin, T, calls, spec):
    root = _model_root()
    ids = _ids(T, _vocab(root / "fp8"))
    theirs = decoder_attention_inputs(root / "native", ids, _schedule(calls, T))
    ours = engine_attention_inputs(hetero_bin, root / "fp8", ids, spec, decoder_calls=calls)
    for layer, (mx_diff, frac) in enumerate(gaps(ours, theirs)):
        assert mx_diff == 0.0 and frac == 0.0, (
            f"T={T} calls={calls} chunks={spec} layer {layer}: max|diff| {mx_diff}, {frac:.2%} "
            "differ"
        )


@pytest.mark.parametrize("T,spec", [(129, "129"), (300, "9,130,7,1,153"), (600, "64,1,1,5,200")])
def test_fp8_checkpoint_dequant_profile_is_bit_exact(hetero_bin, T, spec):
    """The official FP8/FP4 layout in the dequant profile (dequantized at load, float32 sums)
    against the decoder holding the same values densely: its bf16 conversion (exact for
    e4m3/e2m1 times power-of-two scales) with the compressors' ape set back to the official
    float32 values the conversion rounded."""
    root = _model_root()
    ids = _ids(T, _vocab(root / "fp8"))
    theirs = decoder_attention_inputs(root / "bf16", ids, _schedule(spec, T), ape_from=root / "fp8")
    ours = engine_attention_inputs(hetero_bin, root / "fp8", ids, spec, quant_arith="dequant")
    for layer, (mx_diff, frac) in enumerate(gaps(ours, theirs)):
        assert mx_diff == 0.0 and frac == 0.0, (
            f"T={T} chunks={spec} layer {layer}: max|diff| {mx_diff}, {frac:.2%} differ"
        )


def _flag(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    root = Path(os.environ.get("HETERO_DSV4_MODEL", REPO / "models" / "dsv4-tiny"))
    hetero = Path(os.environ.get("HETERO_BIN", REPO / "build" / "hetero"))
    arith = _flag("--quant-arith", "mlx-cpu")
    words = [a for a in sys.argv[1:] if not a.startswith("--") and a != arith]
    variants = words or ["native", "bf16", "fp8"]
    for variant in variants:
        # native: engine on fp8/ vs the served decoder; bf16/fp8: engine on that vs bf16/.
        decoder = root / ("native" if variant == "native" else "bf16")
        engine_model = root / ("fp8" if variant == "native" else variant)
        print(f"engine on {engine_model.name}/ ({arith}) vs decoder on {decoder.name}/: "
              "per layer max|diff| / fraction differing")
        for case in NATIVE_CASES if variant == "native" else CASES:
            T, spec = case.values if hasattr(case, "values") else case
            if T > 4096 and "--slow" not in sys.argv:
                continue
            ids = _ids(T, _vocab(root / "bf16"))
            ape = root / "fp8" if variant == "fp8" and "--official-ape" in sys.argv else None
            theirs = decoder_attention_inputs(decoder, ids, _schedule(spec, T), ape)
            ours = engine_attention_inputs(hetero, engine_model, ids, spec, arith)
            cells = "  ".join(f"{m:.3g}/{f:.2%}" for m, f in gaps(ours, theirs))
            print(f"T={T:4d} chunks={spec:16s} {cells}", flush=True)
