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

__all__ = [
    "PostLocalSGDState",
    "post_localSGD_hook",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
]
