"""Quantized communication: gradients sent as a few bits per element, and what that takes.

One module a concern:

* ``blocks``: the math, tensors to block-scaled codes and back (and PyTorch's min-max affine
  uint8 scheme); pure tensor code that never communicates.
* ``hook``: ``quantized_hook``, the two-phase int8/int4 pipeline.
* ``state``: its options (``QuantizationOptions``), its state (``QuantizationState``: error
  memories, buffers, checkpoints) and bucket bookkeeping.
* ``pytorch_hooks``: PyTorch's uint8 quantization hooks under their own names.
* ``triton_launch`` and ``triton_kernels``: the GPU kernels of the math's fused passes, and the
  checks and launches that dispatch to them. (The CPU kernels live in
  :mod:`commhooks.compress.cpu_kernels`, beside the other C code.)
"""

from commhooks.hooks.quantized.hook import QuantizationOptions, QuantizationState, quantized_hook
from commhooks.hooks.quantized.pytorch_hooks import (
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
