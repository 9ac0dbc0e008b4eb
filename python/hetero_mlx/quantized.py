"""A projection exported as the decoder computes with it, for the prefill host's cache programs
(both families): dense as its weight, quantized as element values and scales, because the
decoder's quantized matmul does not compute with a dequantized weight (src/bridge/
decoder_weights.h, DecoderLinear)."""

from typing import Dict

import mlx.core as mx
import mlx.nn as nn


def linear_weights(prefix: str, linear: nn.Module, out: Dict[str, mx.array]) -> None:
    """A projection as the decoder computes with it.

    Dense: `weight`. Quantized: the decoder's quantized matmul accumulates in its activation
    dtype group by group, so a dequantized weight would not reproduce it; exported instead are
    the element values `qvalues` [n, k] (fp4/fp8 values for the mx modes, integers for affine),
    the `scales` [n, k/group] as values, and for affine the `biases`.
    """
    if not isinstance(linear, nn.QuantizedLinear):
        out[prefix + "weight"] = linear.weight
        return
    mode, gs, bits = linear.mode, linear.group_size, linear.bits
    if mode == "affine":
        unit = mx.ones(linear.scales.shape, dtype=mx.float32)
        zero = mx.zeros(linear.scales.shape, dtype=mx.float32)
        out[prefix + "qvalues"] = mx.dequantize(
            linear.weight, unit, zero, group_size=gs, bits=bits, mode=mode
        )
        out[prefix + "scales"] = linear.scales.astype(mx.float32)
        out[prefix + "biases"] = linear.biases.astype(mx.float32)
    elif mode in ("mxfp4", "mxfp8"):
        unit = mx.full(linear.scales.shape, 127, dtype=mx.uint8)  # 2^0
        out[prefix + "qvalues"] = mx.dequantize(
            linear.weight, unit, group_size=gs, bits=bits, mode=mode
        ).astype(mx.float32)
        # UE8M0 scale byte s is 2^(s-127); byte 0 is the bf16 subnormal 2^-127 in the decoder.
        exponent = linear.scales.astype(mx.int32) - 127
        out[prefix + "scales"] = mx.where(
            linear.scales == 0, mx.array(2.0**-127, dtype=mx.float32), mx.power(2.0, exponent)
        ).astype(mx.float32)
    else:
        raise ValueError(f"{prefix}: quantization mode {mode!r} is not supported")
