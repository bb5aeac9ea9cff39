"""Quantized communication: gradients sent as a few bits per element.

``hook``: ``quantized_hook``, the two-phase int8/int4 average, whose ``phases`` it shares with
its ``two_hops`` path; ``options``: its options; ``state``: its state (memories, workspaces,
checkpoints); ``layout``: a bucket's rows and the buffers it reuses; ``pytorch_hooks``:
PyTorch's uint8 hooks. The math is :mod:`commhooks.compress`'s.
"""

from commhooks.hooks.quantized.hook import quantized_hook
from commhooks.hooks.quantized.options import QuantizationOptions
from commhooks.hooks.quantized.pytorch_hooks import (
    quantization_perchannel_hook,
    quantization_pertensor_hook,
)
from commhooks.hooks.quantized.state import QuantizationState

__all__ = [
    "QuantizationOptions",
    "QuantizationState",
    "quantization_perchannel_hook",
    "quantization_pertensor_hook",
    "quantized_hook",
]
