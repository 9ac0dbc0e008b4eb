"""Bit-exactness of the llama-family cache against the decoder's own (mlx-lm on MLX CPU, bf16).

For tiny random checkpoints of each llama-family variant (llama with GQA 3 and head_dim 64,
qwen2 with q/k/v biases, qwen3 with q/k norms and head_dim*heads != hidden, mistral, and each
rope scaling mlx-lm implements; "dynamic" within max_position_embeddings), and
awkward prompt lengths T, the truth is the decoder's native cache after a prefill done the way
mlx-lm's server does it (make_prompt_cache, steps of 2048). Each layer's attention input is
recorded on the way by wrapping `layer.self_attn` here in the test; the decoder is unmodified.

  same-input   `hetero program` on the recorded inputs, in uneven chunkings: the cache program
               alone must reproduce the native keys/values bit for bit.
  end-to-end   `hetero prefill --ids-file`: our CPU prefill engine computes the inputs itself,
               then tap -> program -> wire -> verifier; the assembled cache must be bit-exact.

Needs HETERO_TOKENIZER (a real tokenizer; the checkpoints are random) and the `hetero` binary
(HETERO_BIN, default build/hetero). T=5003 cases are marked slow.
"""

import json
import os
import subprocess
from pathlib import Path
from dataclasses import replace
from typing import Dict, List, NamedTuple, Optional

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm import convert  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

from hetero_mlx.export import export  # noqa: E402
from hetero_mlx.llama import array_names, cache_arrays  # noqa: E402
from hetero_mlx.tiny import TinyShape, make_tiny_llama  # noqa: E402

# mlx-lm server's default prefill_step_size: the native truth is prefilled in these steps.
SERVER_PREFILL_STEP = 2048
ALL_T = (1, 2, 127, 128, 129, 2047, 2048, 2049, 5003)
SLOW_T = 5003
COMMAND_TIMEOUT_S = 600


class Variant(NamedTuple):
    shape: TinyShape
    seed: int
    lengths: tuple
    # None: all of PROGRAM_CHUNKINGS / PREFILL_CHUNKS; the rope variants take a subset.
    program_chunkings: Optional[tuple] = None
    prefill_chunks: Optional[tuple] = None
    # (bits, group[, mode]): the checkpoint both sides run is mlx-lm's own quantization of the
    # tiny one (mlx_lm.convert -q, affine unless a mode is named), as people run models on their
    # Macs.
    quantize: Optional[tuple] = None


def _scaled(shape: TinyShape, mpe: int = 131072, **scaling) -> TinyShape:
    return replace(shape, rope_scaling=json.dumps(scaling), max_position_embeddings=mpe)


ROPE_PROGRAM_CHUNKINGS = ("T", "100,27")
ROPE_PREFILL_CHUNKS = (97, 2048)


VARIANTS: Dict[str, Variant] = {
    # SmolLM-like attention (9 heads, GQA 3, head_dim 64) on a narrow residual; untied head.
    "llama": Variant(
        TinyShape("llama", 2, 144, 9, 3, 64, 384, tie=False, rope_theta=10000.0), 11, ALL_T
    ),
    "qwen2": Variant(
        TinyShape("qwen2", 2, 128, 4, 2, 0, 256, tie=True, rope_theta=1000000.0),
        12,
        (1, 129, 2048, 5003),
    ),
    "qwen3": Variant(
        TinyShape("qwen3", 2, 96, 4, 1, 32, 192, tie=True, rope_theta=1000000.0),
        13,
        (2, 127, 2049, 5003),
    ),
    "mistral": Variant(
        TinyShape("mistral", 2, 64, 4, 2, 16, 128, tie=False, rope_theta=100000.0),
        14,
        (128, 2047),
    ),
    # The rope scalings mlx-lm implements (docs/findings/rope-variants-in-mlx.md), with the
    # settings real checkpoints carry, over prompts that reach every band they change.
    "llama31": Variant(  # Llama 3.1 / 3.2 / 3.3
        _scaled(
            TinyShape("llama", 2, 128, 2, 1, 64, 256, tie=True, rope_theta=500000.0),
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        21,
        (129, 2049, 5003),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
    ),
    "llama-linear-traditional": Variant(
        replace(
            _scaled(TinyShape("llama", 2, 64, 4, 2, 16, 128), type="linear", factor=2.0),
            rope_traditional=True,
        ),
        22,
        (127, 2049),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
    ),
    "qwen2-yarn": Variant(  # Qwen2.5's long-context setting: YaRN, which also scales q and k
        _scaled(
            TinyShape("qwen2", 2, 128, 4, 2, 0, 256, rope_theta=1000000.0),
            type="yarn",
            factor=4.0,
            original_max_position_embeddings=32768,
        ),
        23,
        (129, 2049),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
    ),
    "qwen3-yarn-v5": Variant(  # Qwen3's YaRN, written the transformers-v5 way
        replace(
            _scaled(
                TinyShape("qwen3", 2, 96, 4, 1, 32, 192, tie=True, rope_theta=1000000.0),
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=32768,
            ),
            rope_parameters=True,
        ),
        24,
        (2, 2049),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
    ),
    "llama-longrope": Variant(  # Phi-3-style, per-pair long factors
        _scaled(
            TinyShape("llama", 2, 64, 4, 2, 16, 128),
            type="longrope",
            original_max_position_embeddings=4096,
            short_factor=[1.0] * 8,
            long_factor=[1.0 + 0.37 * i for i in range(8)],
        ),
        25,
        (128, 2047),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
    ),
    # Dynamic NTK within max_position_embeddings, where every call has one base (the bracket
    # is 1 up to a double rounding at this factor and length; past it no prompt is bridged).
    "llama-dynamic": Variant(
        _scaled(TinyShape("llama", 2, 64, 4, 2, 16, 128), mpe=3333, type="dynamic", factor=5.7),
        27,
        (129, 2049),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
    ),
    # Sliding-window layers (every other one), prompts within the window: their caches then hold
    # every row in order.
    "llama-sliding": Variant(
        TinyShape("llama", 2, 64, 4, 2, 16, 128, sliding_window=2100),
        28,
        (129, 2049),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
    ),
    # Past the window: layer 1 attends over its last 300 positions only, which layer 2's rows
    # show; the sliding layer's cache is its window (cache_arrays). Lengths whose calls of 2048
    # all have more than one token: a one-token call past the window sums in its rotating
    # cache's order, and such requests are refused (check_sliding_calls).
    "llama-sliding-past": Variant(
        TinyShape("llama", 3, 64, 4, 2, 16, 128, sliding_window=300),
        29,
        (300, 1000, 2500),
        ROPE_PROGRAM_CHUNKINGS,
        (97, 2048, 1),
    ),
    # mlx-lm-quantized decoders (affine): the engine and the cache program compute the quantized
    # matmuls as the decoder does (embedding, every projection; qwen2's biases after them).
    "llama-q4": Variant(
        TinyShape("llama", 2, 128, 2, 1, 64, 256, tie=False, rope_theta=500000.0),
        31,
        (129, 2049),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
        quantize=(4, 64),
    ),
    "qwen2-q8": Variant(
        TinyShape("qwen2", 2, 128, 4, 2, 0, 256, rope_theta=1000000.0),
        32,
        (127, 2048),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
        quantize=(8, 32),
    ),
    "qwen3-q4": Variant(
        TinyShape("qwen3", 2, 128, 4, 1, 32, 256, tie=True, rope_theta=1000000.0),
        33,
        (2, 129),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
        quantize=(4, 32),
    ),
    # MLX's microscaling modes: e2m1 / e4m3 codes with a power-of-two scale per 32 columns.
    "llama-mxfp4": Variant(
        TinyShape("llama", 2, 128, 2, 1, 64, 256, tie=False, rope_theta=500000.0),
        34,
        (129, 2049),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
        quantize=(4, 32, "mxfp4"),
    ),
    "qwen2-mxfp8": Variant(
        TinyShape("qwen2", 2, 128, 4, 2, 0, 256, rope_theta=1000000.0),
        35,
        (127, 2048),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
        quantize=(8, 32, "mxfp8"),
    ),
    "llama-proportional": Variant(  # the last pairs stay unrotated
        _scaled(
            TinyShape("llama", 2, 64, 4, 2, 16, 128),
            rope_type="proportional",
            partial_rotary_factor=0.5,
            factor=2.0,
        ),
        26,
        (129,),
        ROPE_PROGRAM_CHUNKINGS,
        ROPE_PREFILL_CHUNKS,
    ),
}

# Program chunkings, repeated by the program to cover T; "T" is the whole prompt at once.
PROGRAM_CHUNKINGS = ("T", "1", "100,27", "127,1,2048", "129,2047,3")
PREFILL_CHUNKS = (97, 2048, 1)


def _cases(kind: str) -> List:
    out = []
    for name, variant in VARIANTS.items():
        if kind == "program":
            chunkings = variant.program_chunkings or PROGRAM_CHUNKINGS
        else:
            chunkings = variant.prefill_chunks or PREFILL_CHUNKS
        for T in variant.lengths:
            for chunking in chunkings:
                marks = [pytest.mark.slow] if T == SLOW_T else []
                case_id = f"{name}-T{T}-{chunking}"
                out.append(pytest.param(name, T, chunking, marks=marks, id=case_id))
    return out


# ---- the decoder's truth ---------------------------------------------------------------------


class _Recorder(nn.Module):
    """Stands in for a layer's self_attn and keeps what it is called with: the attention input."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.inputs: List[mx.array] = []

    def __call__(self, x, *args, **kwargs):
        self.inputs.append(x)
        return self.inner(x, *args, **kwargs)


class Native(NamedTuple):
    ids: Path  # JSON array
    inputs: Path  # layers.{i}.x bf16 [T, hidden]
    cache: Path  # layers.{i}.keys/values [kv_heads, T, head_dim]


class Lab:
    """Builds each variant once and each (variant, T) truth once, in one session directory."""

    def __init__(self, root: Path, tokenizer_dir: Path):
        self.root = root
        self.tokenizer_dir = tokenizer_dir
        self._models: Dict[str, object] = {}
        self._natives: Dict[tuple, Native] = {}

    def model_dir(self, name: str) -> Path:
        return self.root / name / "hf"

    def export_dir(self, name: str) -> Path:
        return self.root / name / "export"

    def model(self, name: str):
        if name not in self._models:
            variant = VARIANTS[name]
            if variant.quantize:
                source = self.root / name / "bf16"
                make_tiny_llama(self.tokenizer_dir, source, variant.seed, variant.shape)
                bits, group, mode = (*variant.quantize, "affine")[:3]
                convert(str(source), str(self.model_dir(name)), quantize=True, q_bits=bits,
                        q_group_size=group, q_mode=mode)
            else:
                make_tiny_llama(self.tokenizer_dir, self.model_dir(name), variant.seed,
                                variant.shape)
            meta = export(str(self.model_dir(name)), self.export_dir(name))
            assert meta["model_type"] == variant.shape.model_type
            assert meta["qk_norm"] == (variant.shape.model_type == "qwen3")
            assert meta["kv_bias"] == (variant.shape.model_type == "qwen2")
            if variant.quantize:
                bits, group, mode = (*variant.quantize, "affine")[:3]
                assert meta["quantization"]["bits"] == bits, meta["quantization"]
                assert meta["quantization"]["group_size"] == group, meta["quantization"]
                assert meta["quantization"]["mode"] == mode, meta["quantization"]
            else:
                assert meta["quantization"] is None, meta["quantization"]
            self._models[name], _ = load(str(self.model_dir(name)))
        return self._models[name]

    def native(self, name: str, T: int) -> Native:
        key = (name, T)
        if key not in self._natives:
            self._natives[key] = self._prefill_natively(name, T)
        return self._natives[key]

    def _prefill_natively(self, name: str, T: int) -> Native:
        model = self.model(name)
        rng = np.random.default_rng([VARIANTS[name].seed, T])
        ids = rng.integers(0, model.args.vocab_size, size=T).tolist()
        layers = model.layers
        recorders = [_Recorder(layer.self_attn) for layer in layers]
        try:
            for layer, rec in zip(layers, recorders):
                layer.self_attn = rec
            cache = make_prompt_cache(model)
            tokens = mx.array(ids)[None]
            for start in range(0, T, SERVER_PREFILL_STEP):
                model(tokens[:, start : start + SERVER_PREFILL_STEP], cache=cache)
                mx.eval([c.state for c in cache] + [x for r in recorders for x in r.inputs])
        finally:
            for layer, rec in zip(layers, recorders):
                layer.self_attn = rec.inner
        assert all(c.offset == T for c in cache), [c.offset for c in cache]
        inputs = {
            f"layers.{i}.x": mx.concatenate([x[0] for x in rec.inputs], axis=0)
            for i, rec in enumerate(recorders)
        }
        for name_x, x in inputs.items():
            assert x.shape == (T, model.args.hidden_size) and x.dtype == mx.bfloat16, name_x
        out = self.root / name / f"T{T}"
        out.mkdir(parents=True, exist_ok=True)
        native = Native(out / "ids.json", out / "inputs.safetensors", out / "native.safetensors")
        native.ids.write_text(json.dumps(ids))
        mx.save_safetensors(str(native.inputs), inputs)
        mx.save_safetensors(str(native.cache), cache_arrays(cache, T))
        return native


@pytest.fixture(scope="session")
def lab(tmp_path_factory, tokenizer_dir) -> Lab:
    return Lab(tmp_path_factory.mktemp("exactness"), tokenizer_dir)


# ---- running and judging hetero ------------------------------------------------------------


def _env() -> Dict[str, str]:
    # (hetero itself sets OMP_WAIT_POLICY=passive; see apps/hetero/main.cc.)
    return dict(os.environ)


def _run(hetero_bin: Path, *args) -> subprocess.CompletedProcess:
    cmd = [str(hetero_bin)] + [str(a) for a in args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=_env()
    )


def _bf16_bits(a) -> np.ndarray:
    return np.array(a.view(mx.uint16))


def _bits_to_float(bits) -> float:
    return float(np.array([int(bits) << 16], dtype=np.uint32).view(np.float32)[0])


def first_differences(got: Path, want: Path) -> str:
    """Per array: how many elements differ and the first differing (head, token, dim) by token
    order, so a failure says where it starts (layer 0 exact but layer 1 not = the engine's
    layer-0 forward, not the cache program)."""
    g_all, w_all = mx.load(str(got)), mx.load(str(want))
    lines = []
    for name in sorted(w_all, key=lambda n: (int(n.split(".")[1]), n)):
        if name not in g_all:
            lines.append(f"{name}: missing")
            continue
        g, w = _bf16_bits(g_all[name]), _bf16_bits(w_all[name])
        if g.shape != w.shape:
            lines.append(f"{name}: shape {g.shape} vs {w.shape}")
            continue
        diff = np.argwhere(g != w)
        if len(diff) == 0:
            lines.append(f"{name}: exact")
            continue
        h, t, d = diff[np.lexsort((diff[:, 2], diff[:, 0], diff[:, 1]))[0]]
        lines.append(
            f"{name}: {len(diff)}/{g.size} differ, first at token {t} head {h} dim {d}: "
            f"got {_bits_to_float(g[h, t, d])!r} want {_bits_to_float(w[h, t, d])!r}"
        )
    return "\n".join(lines)


def as_the_decoder_holds(got: Path, name: str, T: int) -> Path:
    """Our T rows per layer as the decoder holds them: a sliding layer past its window keeps
    the window's last rows (cache_arrays), the rest every row. Only the layers the variant
    makes sliding are cut, by exactly the window, so a wrong row count still fails."""
    shape = VARIANTS[name].shape
    if not shape.sliding_window or T <= shape.sliding_window:
        return got
    arrays = mx.load(str(got))
    for i in range(1, shape.layers, 2):  # TinyShape: the odd layers slide
        for kind in ("keys", "values"):
            key = f"layers.{i}.{kind}"
            arrays[key] = mx.contiguous(arrays[key][:, T - shape.sliding_window :, :])
    out = got.with_name(got.stem + "-held.safetensors")
    mx.save_safetensors(str(out), arrays)
    return out


def assert_bit_exact(hetero_bin: Path, got: Path, want: Path, layers: int, what: str) -> None:
    res = _run(hetero_bin, "compare", got, want)
    try:
        report = json.loads(res.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"{what}: compare printed no JSON (rc {res.returncode}): {res.stderr}")
    if res.returncode != 0 or not report.get("pass"):
        pytest.fail(
            f"{what}: not bit-exact (compare rc {res.returncode})\n"
            f"{first_differences(got, want)}\ncompare: {res.stdout[:2000]}"
        )
    assert report["tensors"] == 2 * layers and report["bit_exact_tensors"] == 2 * layers, report


# ---- same input: the cache program alone ---------------------------------------------------


@pytest.mark.parametrize("name,T,chunking", _cases("program"))
def test_program_same_input(lab, hetero_bin, tmp_path, name, T, chunking):
    native = lab.native(name, T)
    chunks = str(T) if chunking == "T" else chunking
    out = tmp_path / "program.safetensors"
    res = _run(
        hetero_bin, "program", "--weights", lab.export_dir(name), "--inputs", native.inputs,
        "--chunks", chunks, "--out", out,
    )  # fmt: skip
    assert res.returncode == 0, f"program failed ({res.returncode}): {res.stderr}"
    layers = VARIANTS[name].shape.layers
    assert_bit_exact(hetero_bin, as_the_decoder_holds(out, name, T), native.cache, layers,
                     f"program {name} T={T} chunks={chunks}")


# ---- end to end: our prefill engine, tap, program, wire, verifier --------------------------


@pytest.mark.parametrize("name,T,chunk", _cases("prefill"))
def test_prefill_end_to_end(lab, hetero_bin, tmp_path, name, T, chunk):
    native = lab.native(name, T)
    out = tmp_path / "prefill.safetensors"
    # The decoder's calls, as the truth was prefilled (a sliding window past T needs them named).
    calls = ",".join(str(min(SERVER_PREFILL_STEP, T - s)) for s in range(0, T, SERVER_PREFILL_STEP))
    res = _run(
        hetero_bin, "prefill", "--model", lab.model_dir(name), "--weights", lab.export_dir(name),
        "--ids-file", native.ids, "--chunk", chunk, "--decoder-calls", calls,
        "--decoder-path", "single", "--out", out,
    )  # fmt: skip
    assert res.returncode == 0, f"prefill failed ({res.returncode}): {res.stderr}"
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["T"] == T
    layers = VARIANTS[name].shape.layers
    assert_bit_exact(hetero_bin, as_the_decoder_holds(out, name, T), native.cache, layers,
                     f"prefill {name} T={T} chunk={chunk}")


# ---- bad inputs fail loudly ----------------------------------------------------------------


def _write_without(src: Path, dst: Path, drop: str) -> None:
    arrays = mx.load(str(src))
    del arrays[drop]
    mx.save_safetensors(str(dst), arrays)


def test_program_refuses_missing_layer_input(lab, hetero_bin, tmp_path):
    native = lab.native("llama", 129)
    inputs = tmp_path / "inputs.safetensors"
    _write_without(native.inputs, inputs, "layers.1.x")
    out = tmp_path / "out.safetensors"
    res = _run(
        hetero_bin, "program", "--weights", lab.export_dir("llama"), "--inputs", inputs,
        "--chunks", "64", "--out", out,
    )  # fmt: skip
    assert res.returncode != 0, f"program accepted inputs without layers.1.x: {res.stdout}"
    assert "layers.1.x" in res.stderr, res.stderr


def test_program_refuses_inputs_of_another_model(lab, hetero_bin, tmp_path):
    native = lab.native("qwen2", 129)  # hidden 128 inputs into llama's hidden-144 weights
    res = _run(
        hetero_bin, "program", "--weights", lab.export_dir("llama"), "--inputs", native.inputs,
        "--chunks", "64", "--out", tmp_path / "out.safetensors",
    )  # fmt: skip
    assert res.returncode != 0, f"program accepted another model's inputs: {res.stdout}"


def test_compare_fails_on_one_flipped_bit(lab, hetero_bin, tmp_path):
    native = lab.native("llama", 129)
    arrays = mx.load(str(native.cache))
    bits = _bf16_bits(arrays["layers.1.values"]).copy()
    bits[2, 128, 63] ^= 1  # last element, lowest mantissa bit: one ULP
    arrays["layers.1.values"] = mx.array(bits).view(mx.bfloat16)
    flipped = tmp_path / "flipped.safetensors"
    mx.save_safetensors(str(flipped), arrays)
    res = _run(hetero_bin, "compare", flipped, native.cache)
    assert res.returncode != 0, res.stdout
    report = json.loads(res.stdout)
    assert not report["pass"]
    assert [f["name"] for f in report["failures"]] == ["layers.1.values"], report
    assert "layers.1.values: 1/" in first_differences(flipped, native.cache)


def test_compare_fails_on_missing_tensor_and_shape(lab, hetero_bin, tmp_path):
    native = lab.native("llama", 129)
    partial = tmp_path / "partial.safetensors"
    _write_without(native.cache, partial, "layers.0.keys")
    assert _run(hetero_bin, "compare", partial, native.cache).returncode != 0
    shorter = lab.native("llama", 128)
    assert _run(hetero_bin, "compare", shorter.cache, native.cache).returncode != 0


def test_prefill_refuses_wrong_fingerprint(lab, hetero_bin, tmp_path):
    native = lab.native("llama", 127)
    base = ["prefill", "--model", lab.model_dir("llama"), "--ids-file", native.ids]
    res = _run(
        hetero_bin, *base, "--weights", lab.export_dir("llama"), "--fingerprint", "0" * 32,
        "--out", tmp_path / "a.safetensors",
    )  # fmt: skip
    assert res.returncode != 0, f"prefill accepted a wrong fingerprint: {res.stdout}"


# Regression: prefill once accepted another model's export and read tap rows with the
# export's hidden size (a heap over-read when it was larger).
def test_prefill_refuses_weights_of_another_model(lab, hetero_bin, tmp_path):
    native = lab.native("llama", 127)
    lab.model("qwen2")  # builds its export: hidden 128 (llama's is 144), so no over-read here
    res = _run(
        hetero_bin, "prefill", "--model", lab.model_dir("llama"), "--ids-file", native.ids,
        "--weights", lab.export_dir("qwen2"), "--out", tmp_path / "b.safetensors",
    )  # fmt: skip
    assert res.returncode != 0, f"prefill accepted another model's decoder weights: {res.stdout}"
    assert "does not match the model" in res.stderr


def test_program_refuses_an_export_whose_rope_frequencies_differ(lab, hetero_bin, tmp_path):
    """The export carries the decoder module's own frequencies; one that differs from what the
    config computes to (a stale or edited export) is refused, never used."""
    lab.model("llama31")
    doctored = tmp_path / "export"
    doctored.mkdir()
    src = lab.export_dir("llama31")
    (doctored / "decoder.json").write_text((src / "decoder.json").read_text())
    arrays = mx.load(str(src / "weights.safetensors"))
    freqs = np.array(arrays["rope.freqs"])
    freqs[5] = np.nextafter(freqs[5], np.float32(np.inf))
    arrays["rope.freqs"] = mx.array(freqs)
    mx.save_safetensors(str(doctored / "weights.safetensors"), arrays)
    native = lab.native("llama31", 129)
    res = _run(
        hetero_bin, "program", "--weights", doctored, "--inputs", native.inputs,
        "--chunks", "64", "--out", tmp_path / "out.safetensors",
    )  # fmt: skip
    assert res.returncode != 0, f"program used a doctored rope: {res.stdout}"
    assert "rope frequency 5" in res.stderr, res.stderr


# A prompt past the variant's reach (the longest whose cache it computes), and what the refusal
# says: past max_position_embeddings a dynamic NTK rope recomputes its base per call, so its keys
# depend on the decoder's call schedule.
REACH = {
    "llama-dynamic": (3333, ["past max_position_embeddings (3333)", "dynamic (factor 5.7)"]),
}


@pytest.mark.parametrize("name", sorted(REACH))
def test_a_prompt_past_the_reach_is_refused_per_request(lab, hetero_bin, tmp_path, name):
    """Such a prompt is refused, naming why; one at the reach is still bridged by the same
    prefill host and program."""
    reach, words = REACH[name]
    lab.model(name)
    ids = tmp_path / "ids.json"
    # The rows are a prompt's but its last token, which the decoder keeps: reach - 1 rows are of
    # a prompt of `reach` tokens; `reach` rows are of one past it.
    for T in (reach, reach + 1):
        ids.write_text(json.dumps([(7 * i) % 100 + 1 for i in range(T - 1)]))
        res = _run(
            hetero_bin, "prefill", "--model", lab.model_dir(name), "--weights",
            lab.export_dir(name), "--ids-file", ids, "--out", tmp_path / f"out-{T}.safetensors",
        )  # fmt: skip
        if T == reach:
            assert res.returncode == 0, res.stderr
            continue
        assert res.returncode != 0, f"prefill bridged past the reach: {res.stdout}"
        for w in [f"a prompt of {T} tokens is"] + words:
            assert w in res.stderr, res.stderr
    inputs = lab.native(name, 2049).inputs  # the program on recorded rows within the reach
    res = _run(hetero_bin, "program", "--weights", lab.export_dir(name),
               "--inputs", inputs, "--out", tmp_path / "program.safetensors")
    assert res.returncode == 0, res.stderr


def test_quantized_decoder_and_dense_checkpoint_are_refused_naming_both(lab, hetero_bin, tmp_path):
    """mlx-lm's 4-bit conversion against its own bf16 original, both ways: a quantized matmul's
    outputs are not a dense one's, so the prefill host refuses to start, naming both sides."""
    lab.model("llama-q4")
    bf16 = lab.root / "llama-q4" / "bf16"
    export(str(bf16), tmp_path / "bf16-export")
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    for model, weights, words in (
        (bf16, lab.export_dir("llama-q4"), ("4-bit affine, group 64", "bf16")),
        (lab.model_dir("llama-q4"), tmp_path / "bf16-export", ("unquantized", "4-bit affine")),
    ):
        res = _run(
            hetero_bin, "prefill", "--model", model, "--weights", weights, "--ids-file", ids,
            "--out", tmp_path / "out.safetensors",
        )  # fmt: skip
        assert res.returncode != 0, f"prefill paired {model} with {weights}: {res.stdout}"
        for word in words:
            assert word in res.stderr, res.stderr


def test_an_mxfp4_checkpoint_and_an_affine_decoder_are_refused_naming_both(lab, hetero_bin,
                                                                            tmp_path):
    """The same bf16 source quantized by mlx-lm to mxfp4 (the prefill checkpoint) and to 4-bit
    affine (the decoder): the same bits per value, other values and another matmul, so the prefill
    host refuses to start, naming both quantizations."""
    lab.model("llama-mxfp4")
    source = lab.root / "llama-mxfp4" / "bf16"
    affine = tmp_path / "affine"
    convert(str(source), str(affine), quantize=True, q_bits=4, q_group_size=32)
    export(str(affine), tmp_path / "affine-export")
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    res = _run(
        hetero_bin, "prefill", "--model", lab.model_dir("llama-mxfp4"), "--weights",
        tmp_path / "affine-export", "--ids-file", ids, "--out", tmp_path / "out.safetensors",
    )  # fmt: skip
    assert res.returncode != 0, f"prefill paired mxfp4 with affine: {res.stdout}"
    for word in ("4-bit mxfp4, group 32", "4-bit affine, group 32"):
        assert word in res.stderr, res.stderr
