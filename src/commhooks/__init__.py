"""Gradient communication hooks for PyTorch DistributedDataParallel.

Drop-in for ``torch.distributed.algorithms.ddp_comm_hooks``: the same names and arguments,
working on gloo/CPU as well as NCCL/GPU::

    from commhooks import fp16_compress_hook
    ddp_model.register_comm_hook(None, fp16_compress_hook)
"""

from commhooks.config import CommHookType, register
from commhooks.hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)
from commhooks.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__version__ = "0.1.0"

__all__ = [
    "CommHookType",
    "register",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
    "PowerSGDState",
    "batched_powerSGD_hook",
    "powerSGD_hook",
]
