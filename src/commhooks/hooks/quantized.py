"""The quantized hook under its former module name, for code that imports it here.

It lives in :mod:`commhooks.quantized.hook`, its options and state in
:mod:`commhooks.quantized.state`.
"""

from commhooks.quantized.hook import QuantizationOptions, QuantizationState, quantized_hook

__all__ = ["QuantizationOptions", "QuantizationState", "quantized_hook"]
