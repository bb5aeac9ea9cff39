"""The quantization math under its former module name, for code that imports it here.

It lives in :mod:`commhooks.compress.blocks`, beside the hook, the state and the kernels.
"""

from commhooks.compress.blocks import (
    NEAREST,
    RESIDUAL_SLACK,
    ROUNDINGS,
    STOCHASTIC,
    BlockFormat,
    affine_qparams,
    dequantize_,
    dequantize_affine,
    dequantize_sum,
    quantize_,
    quantize_affine,
    requantize_sum_,
    scales_finite,
)

__all__ = [
    "NEAREST",
    "RESIDUAL_SLACK",
    "ROUNDINGS",
    "STOCHASTIC",
    "BlockFormat",
    "affine_qparams",
    "dequantize_",
    "dequantize_affine",
    "dequantize_sum",
    "quantize_",
    "quantize_affine",
    "requantize_sum_",
    "scales_finite",
]
