"""`export`: the decoder's weights and rope configuration for the prefill host's cache program.

Writes, into --out:
  weights.safetensors  the weights the family's cache program needs, as the decoder computes
                       with them. llama: per layer k_proj/v_proj (+ biases, + k_norm),
                       dequantized as the decoder dequantizes. deepseek_v4: see dsv4.py
                       (window and compressor projections, quantized ones as element values +
                       scales, and the decoder's own rope frequencies).
  decoder.json         {"format": "hetero-decoder-weights-v1", "family", "fingerprint",
                        "layers", ..., "dtype", "quantization" (null: unquantized; see
                        llama.quantization), "model" (the checkpoint's absolute path, for the
                        prefill host's messages), "versions"}
The model is loaded as its server loads it: mlx_lm.utils.load for the llama family,
mlx_vlm.utils.load_model for deepseek_v4.
"""

import json
from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
import mlx_lm
from mlx_lm.utils import load

from . import WEIGHTS_FORMAT
from .llama import describe, kv_weights


def sidecar(desc: Dict[str, Any], model_path: str) -> Dict[str, Any]:
    keys = ("family", "model_type", "fingerprint", "layers", "kv_heads", "head_dim", "hidden")
    keys += ("rms_norm_eps", "rope", "qk_norm", "kv_bias", "dtype", "quantization", "sliding_window")
    meta = {"format": WEIGHTS_FORMAT}
    meta.update({k: desc[k] for k in keys})
    meta["model"] = str(Path(model_path).resolve())
    meta["versions"] = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
    return meta


def model_type(model_path: str) -> str:
    try:
        return json.loads((Path(model_path) / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        return ""


def _export_dsv4(model_path: str, out: Path) -> Dict[str, Any]:
    import mlx_vlm
    from mlx_vlm.utils import load_model

    from . import dsv4

    model = load_model(Path(model_path))
    desc = dsv4.describe(model)
    weights = dsv4.cache_weights(model)
    mx.eval(list(weights.values()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "weights.safetensors"), weights, metadata={"format": WEIGHTS_FORMAT}
    )
    keys = ("family", "model_type", "fingerprint", "layers", "hidden", "head_dim")
    keys += ("index_head_dim", "window", "ratios", "rope", "rms_norm_eps", "dtype", "kv_heads")
    keys += ("quantization",)
    meta = {"format": WEIGHTS_FORMAT}
    meta.update({k: desc[k] for k in keys})
    meta["model"] = str(Path(model_path).resolve())
    meta["versions"] = {"mlx": mx.__version__, "mlx_vlm": mlx_vlm.__version__}
    (out / "decoder.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def export(model_path: str, out: Path) -> Dict[str, Any]:
    if model_type(model_path) == "deepseek_v4":
        return _export_dsv4(model_path, out)
    model, _ = load(model_path)
    desc = describe(model)
    weights = kv_weights(model)
    mx.eval(list(weights.values()))
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": WEIGHTS_FORMAT}
    mx.save_safetensors(str(out / "weights.safetensors"), weights, metadata=metadata)
    meta = sidecar(desc, model_path)
    (out / "decoder.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta
