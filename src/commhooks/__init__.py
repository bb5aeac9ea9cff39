"""Gradient communication hooks for PyTorch DistributedDataParallel.

Drop-in for PyTorch's DDP communication hooks: the same names and arguments,
working on gloo/CPU as well as NCCL/GPU::

    from commhooks import fp16_compress_hook
    ddp_model.register_comm_hook(None, fp16_compress_hook)
"""

from commhooks import checkpoint, fsdp
from commhooks._warnings import CommHooksWarning
from commhooks.averaging.averagers import (
    HierarchicalModelAverager,
    ModelAverager,
    OuterOptimizerAverager,
    PeriodicModelAverager,
    average_parameters,
    get_params_to_average,
)
from commhooks.averaging.diloco import DiLoCoOptions, DiLoCoSyncError, StreamingDiLoCo, diloco_hook
from commhooks.averaging.optim import PostLocalSGDOptimizer
from commhooks.averaging.options import (
    HierarchicalAveragerOptions,
    OuterOptimizerOptions,
    PeriodicAveragerOptions,
)
from commhooks.comm.topology import Topology
from commhooks.config import CommHookType, HookConfig, register, register_from_config
from commhooks.hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)
from commhooks.hooks.local_sgd import PostLocalSGDOptions, PostLocalSGDState, post_localSGD_hook
from commhooks.hooks.powersgd import (
    PowerSGDOptions,
    PowerSGDState,
    batched_powerSGD_hook,
    powerSGD_hook,
)
from commhooks.hooks.quantized import (
    QuantizationState,
    quantization_perchannel_hook,
    quantization_pertensor_hook,
    quantized_hook,
)
from commhooks.state import HookState, StateDictError, StatelessState

__version__ = "0.1.0"

__all__ = [
    "CommHooksWarning",
    "HookState",
    "StateDictError",
    "StatelessState",
    "Topology",
    "checkpoint",
    "HierarchicalAveragerOptions",
    "fsdp",
    "HierarchicalModelAverager",
    "ModelAverager",
    "OuterOptimizerAverager",
    "OuterOptimizerOptions",
    "PeriodicAveragerOptions",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "PostLocalSGDOptions",
    "PostLocalSGDState",
    "average_parameters",
    "get_params_to_average",
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
    "PowerSGDOptions",
    "PowerSGDState",
    "batched_powerSGD_hook",
    "powerSGD_hook",
    "QuantizationState",
    "quantization_perchannel_hook",
    "quantization_pertensor_hook",
    "quantized_hook",
    "DiLoCoOptions",
    "DiLoCoSyncError",
    "StreamingDiLoCo",
    "diloco_hook",
]
