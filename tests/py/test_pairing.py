"""Pairings that cannot be exact are refused at start, naming both sides.

Regression: `hetero up --model <4-bit model made by mlx-lm's converter> --prefill-model <its bf16
original>` started, and the bridge mounted a cache that was not the decoder's (0 of 60 arrays
equal, continuation differing at token 2): the fingerprint ignored quantization and nothing
compared the prefill checkpoint's weights with the decoder's.

The default model (SmolLM2-135M, bf16) is quantized here by mlx-lm's own converter (4 bits,
affine, group 64; offline, seconds), and dequantized back to bf16 by the same converter:

- the decoder's fingerprint covers its quantization (seam describe and the export's sidecar);
- `hetero prefill` on the bf16 checkpoint with the q4 decoder's export exits at start with a
  message naming both checkpoints, the q4 quantization and the bf16 storage;
- on the dequantized checkpoint (the q4 decoder's own k/v values, in bf16) it still refuses:
  the decoder's quantized matmuls are not what a dense forward computes;
- `hetero up --model q4 --prefill-model bf16` exits non-zero with that reason in its output;
- the right pairings start (bf16 with its own export, q4 with its own: the prefill host then
  runs the quantized checkpoint as the decoder does; `hetero up` on bf16 and on q4);
- deepseek_v4 (when HETERO_DSV4_MODEL is set): the FP8 checkpoint with the export of the
  mxfp4 conversion (compressors requantized from bf16) is refused naming a compressor weight.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("HETERO_MODEL", ROOT / "models" / "smollm2-135m-instruct"))
PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"), HF_HUB_OFFLINE="1")
START_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*argv, timeout: float = START_S) -> subprocess.CompletedProcess:
    """Runs a command to its end; a refusal at start must not hang, so a timeout fails."""
    try:
        return subprocess.run(
            [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
            env=ENV,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{argv[:3]} did not exit within {timeout} s: {e.stdout!r} {e.stderr!r}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """bf16 (the default model), q4 (mlx-lm's converter) and q4 dequantized back to bf16."""
    if not (MODEL / "config.json").exists():
        pytest.skip(f"no model at {MODEL} (run: make up, or set HETERO_MODEL)")
    root = tmp_path_factory.mktemp("pairing")
    q4, deq = root / "q4", root / "q4-dequantized"
    convert = [PY, "-m", "mlx_lm", "convert", "--hf-path"]
    res = run(*convert, MODEL, "--mlx-path", q4, "-q", "--q-bits", "4", "--q-group-size", "64")
    assert res.returncode == 0, res.stderr
    res = run(*convert, q4, "--mlx-path", deq, "--dequantize")
    assert res.returncode == 0, res.stderr
    return {"bf16": MODEL.resolve(), "q4": q4, "deq": deq, "root": root}


@pytest.fixture(scope="module")
def exports(models):
    from hetero_mlx.export import export

    out = {}
    for name in ("bf16", "q4"):
        out[name] = models["root"] / f"export-{name}"
        export(str(models[name]), out[name])
    return out


def sidecar(export_dir: Path) -> dict:
    return json.loads((export_dir / "decoder.json").read_text())


def test_fingerprint_covers_quantization(models, exports):
    from mlx_lm.utils import load

    from hetero_mlx.llama import describe

    descs = {name: describe(load(str(models[name]))[0]) for name in ("bf16", "q4")}
    assert descs["bf16"]["quantization"] is None
    q = descs["q4"]["quantization"]
    assert {k: q[k] for k in ("mode", "bits", "group_size")} == {
        "mode": "affine", "bits": 4, "group_size": 64,
    }  # fmt: skip
    assert q["modules"] > 0 and q["overrides"] == {}, q
    assert descs["q4"]["fingerprint"] != descs["bf16"]["fingerprint"]
    # The export's sidecar carries the same identity, and where the decoder came from.
    for name in ("bf16", "q4"):
        meta = sidecar(exports[name])
        assert meta["fingerprint"] == descs[name]["fingerprint"]
        assert meta["quantization"] == descs[name]["quantization"]
        assert meta["model"] == str(Path(models[name]).resolve())


def assert_names_both_sides(text: str, decoder: Path, prefill: Path) -> None:
    assert f"the decoder (4-bit affine, group 64, from {Path(decoder).resolve()})" in text, text
    assert f"the prefill checkpoint {prefill} (model.layers.0.self_attn.k_proj.weight: bf16)" in (
        text
    ), text
    assert "the decoder is quantized and the prefill checkpoint is not" in text, text


def test_prefill_refuses_the_q4_decoders_weights(hetero_bin, models, exports):
    res = run(hetero_bin, "prefill", "--model", models["bf16"], "--weights", exports["q4"],
              "--port", "0")  # fmt: skip
    assert res.returncode != 0, res.stderr
    assert "failed_precondition" in res.stderr, res.stderr
    assert_names_both_sides(res.stderr, models["q4"], models["bf16"])


def test_prefill_refuses_a_quantized_decoder_with_equal_values(hetero_bin, models, exports):
    """The dequantized checkpoint holds the q4 decoder's k/v values exactly; still refused."""
    res = run(hetero_bin, "prefill", "--model", models["deq"], "--weights", exports["q4"],
              "--port", "0")  # fmt: skip
    assert res.returncode != 0, res.stderr
    assert "does not hold the decoder's weights" not in res.stderr, res.stderr
    assert_names_both_sides(res.stderr, models["q4"], models["deq"])


@pytest.mark.parametrize("name", ["bf16", "q4"])
def test_prefill_accepts_its_own_decoders_weights(hetero_bin, models, exports, tmp_path, name):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(1, 40))))
    res = run(hetero_bin, "prefill", "--model", models[name], "--weights", exports[name],
              "--ids-file", ids, "--chunk", "16")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["T"] == 39


def up(hetero_bin, tmp_path, model: Path, prefill_model: Path) -> subprocess.CompletedProcess:
    ports = ["--port", free_port(), "--decoder-port", free_port(), "--prefill-port", free_port()]
    return run(hetero_bin, "up", "--exit-when-ready", "--model", model, "--prefill-model",
               prefill_model, "--python", PY, "--work-dir", tmp_path / "work", *ports)  # fmt: skip


def test_up_refuses_q4_decoder_with_bf16_prefill(hetero_bin, models, tmp_path):
    res = up(hetero_bin, tmp_path, models["q4"], models["bf16"])
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "hetero is up" not in out, out
    assert "process exited during start" in out, out
    assert_names_both_sides(out, models["q4"], models["bf16"])


@pytest.mark.parametrize("name", ["bf16", "q4"])
def test_up_starts_the_right_pairing(hetero_bin, models, tmp_path, name):
    res = up(hetero_bin, tmp_path, models[name], models[name])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "hetero is up" in res.stdout, res.stdout


@pytest.fixture(scope="module")
def dsv4_root() -> Path:
    path = os.environ.get("HETERO_DSV4_MODEL")
    if not path:
        pytest.skip("HETERO_DSV4_MODEL is not set (models/dsv4-tiny: run make tiny-dsv4)")
    return Path(path)


def test_dsv4_fp8_checkpoint_refuses_the_mxfp4_conversion(hetero_bin, dsv4_root, tmp_path):
    """mxfp4/ requantizes the compressors (bf16 in the checkpoint); native/ keeps every value."""
    from hetero_mlx.export import export

    for variant in ("native", "mxfp4"):
        export(str(dsv4_root / variant), tmp_path / variant)
    fingerprints = {sidecar(tmp_path / v)["fingerprint"] for v in ("native", "mxfp4")}
    assert len(fingerprints) == 2, fingerprints
    fp8 = dsv4_root / "fp8"
    res = run(hetero_bin, "prefill", "--model", fp8, "--weights", tmp_path / "mxfp4", "--port",
              "0")  # fmt: skip
    assert res.returncode != 0, res.stderr
    assert f"the prefill checkpoint {fp8} does not hold the decoder's weights" in res.stderr
    assert "layers.2.attn.compressor.wkv.weight differs in" in res.stderr, res.stderr
    assert f"from {(dsv4_root / 'mxfp4').resolve()}; prefill: bf16)" in res.stderr, res.stderr
