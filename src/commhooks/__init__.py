"""Gradient communication hooks for PyTorch DistributedDataParallel.

Drop-in for PyTorch's DDP communication hooks: the same names and arguments,
working on gloo/CPU as well as NCCL/GPU::

    from commhooks import fp16_compress_hook
    ddp_model.register_comm_hook(None, fp16_compress_hook)
"""

from commhooks import checkpoint
from commhooks._warnings import CommHooksWarning
from commhooks.averagers import (
    HierarchicalModelAverager,
    ModelAverager,
    OuterOptimizerAverager,
    PeriodicModelAverager,
    average_parameters,
)
from commhooks.config import CommHookType, HookConfig, register, register_from_config
from commhooks.hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)
from commhooks.hooks.local_sgd import PostLocalSGDState, post_localSGD_hook
from commhooks.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from commhooks.optim import PostLocalSGDOptimizer
from commhooks.state import HookState, StateDictError, StatelessState

__version__ = "0.1.0"

__all__ = [
    "CommHooksWarning",
    "HookState",
    "StateDictError",
    "StatelessState",
    "checkpoint",
    "HierarchicalModelAverager",
    "ModelAverager",
    "OuterOptimizerAverager",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "PostLocalSGDState",
    "average_parameters",
    "post_localSGD_hook",
    "CommHookType",
    "HookConfig",
    "register",
    "register_from_config",
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
