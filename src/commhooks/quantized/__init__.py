"""Quantized communication: gradients sent as a few bits per element, and what that takes.

One module a concern:

* :mod:`~commhooks.quantized.blocks`: the math, tensors to block-scaled codes and back (and
  PyTorch's min-max affine uint8 scheme); pure tensor code that never communicates.
* :mod:`~commhooks.quantized.hook`: ``quantized_hook``, the two-phase int8/int4 pipeline.
* :mod:`~commhooks.quantized.state`: its options (``QuantizationOptions``), its state
  (``QuantizationState``: error memories, buffers, checkpoints) and bucket bookkeeping.
* :mod:`~commhooks.quantized.pytorch_hooks`: PyTorch's uint8 quantization hooks under their own
  names.
* :mod:`~commhooks.quantized.triton_launch` and :mod:`~commhooks.quantized.triton_kernels`: the
  GPU kernels of the math's fused passes, and the checks and launches that dispatch to them.
  (The CPU kernels live in :mod:`commhooks.cpu_kernels`, beside the other C code.)
"""

from commhooks.quantized.hook import QuantizationOptions, QuantizationState, quantized_hook
from commhooks.quantized.pytorch_hooks import (
    quantization_perchannel_hook,
    quantization_pertensor_hook,
)

__all__ = [
    "QuantizationOptions",
    "QuantizationState",
    "quantization_perchannel_hook",
    "quantization_pertensor_hook",
    "quantized_hook",
]
