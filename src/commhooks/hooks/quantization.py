"""PyTorch's uint8 quantization hooks under their former module name, for code that imports
them here. They live in :mod:`commhooks.hooks.quantized.pytorch_hooks`.
"""

from commhooks.hooks.quantized.pytorch_hooks import (
    quantization_perchannel_hook,
    quantization_pertensor_hook,
)

__all__ = ["quantization_perchannel_hook", "quantization_pertensor_hook"]
