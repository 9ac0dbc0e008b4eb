"""`export`: the decoder's weights and rope configuration for the prefill host's cache program.

Writes, into --out:
  weights.safetensors  per layer k_proj/v_proj weights (+ biases, + k_norm for q/k-norm
                       models), dequantized as the decoder dequantizes, dtype kept as loaded
  decoder.json         {"format": "hetero-decoder-weights-v1", "family", "fingerprint",
                        "layers", "kv_heads", "head_dim", "hidden", "rms_norm_eps", "rope",
                        "dtype", "versions"}
The model is loaded with mlx_lm.utils.load, as the server loads it.
"""

import json
from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
import mlx_lm
from mlx_lm.utils import load

from . import WEIGHTS_FORMAT
from .llama import describe, kv_weights


def sidecar(desc: Dict[str, Any]) -> Dict[str, Any]:
    keys = ("family", "model_type", "fingerprint", "layers", "kv_heads", "head_dim", "hidden")
    keys += ("rms_norm_eps", "rope", "qk_norm", "kv_bias", "dtype")
    meta = {"format": WEIGHTS_FORMAT}
    meta.update({k: desc[k] for k in keys})
    meta["versions"] = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
    return meta


def export(model_path: str, out: Path) -> Dict[str, Any]:
    model, _ = load(model_path)
    desc = describe(model)
    weights = kv_weights(model)
    mx.eval(list(weights.values()))
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": WEIGHTS_FORMAT}
    mx.save_safetensors(str(out / "weights.safetensors"), weights, metadata=metadata)
    meta = sidecar(desc)
    (out / "decoder.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta
