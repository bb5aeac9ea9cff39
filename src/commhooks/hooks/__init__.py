"""Hook families, one module each."""

from commhooks.hooks.debugging import noop_hook
from commhooks.hooks.default import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from commhooks.hooks.local_sgd import PostLocalSGDState, post_localSGD_hook
from commhooks.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from commhooks.hooks.quantized import (
    QuantizationState,
    quantization_perchannel_hook,
    quantization_pertensor_hook,
    quantized_hook,
)

__all__ = [
    "PostLocalSGDState",
    "post_localSGD_hook",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
    "PowerSGDState",
    "batched_powerSGD_hook",
    "powerSGD_hook",
    "QuantizationState",
    "quantization_perchannel_hook",
    "quantization_pertensor_hook",
    "quantized_hook",
]
