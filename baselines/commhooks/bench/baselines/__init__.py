"""PyTorch's own communication hooks, registered for ``commhooks bench --compare-torch``.

The benchmark compares commhooks with PyTorch's reference hooks. Those are imported here only:
this package is part of the bench (``commhooks.bench.baselines``), but its source stands apart
from the library's (``baselines/`` in the repository; the wheel places it in the bench), so that
the library itself never imports them.
"""

from collections.abc import Callable
from typing import Any

__all__ = ["attach_torch"]


def attach_torch(
    ddp: Any, name: str, options: dict[str, Any], *, averager_period: int
) -> Callable[[], None]:
    """Register PyTorch's hook ``name`` (``torch_power_sgd``...) on ``ddp``.

    Returns the callable to run after each optimizer step (the model averager for
    ``torch_post_local_sgd``, a no-op otherwise).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import (
        debugging_hooks,
        default_hooks,
        post_localSGD_hook,
        powerSGD_hook,
        quantization_hooks,
    )

    if name == "torch_power_sgd" or name == "torch_batched_power_sgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, **options)
        fn = (
            powerSGD_hook.powerSGD_hook
            if name == "torch_power_sgd"
            else powerSGD_hook.batched_powerSGD_hook
        )
        ddp.register_comm_hook(state, fn)
        return lambda: None
    if name == "torch_post_local_sgd":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=None, **options)
        ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        warmup = options["start_localSGD_iter"]
        averager = PeriodicModelAverager(period=averager_period, warmup_steps=warmup)
        return lambda: averager.average_parameters(ddp.module.parameters())
    simple = {
        "torch_noop": debugging_hooks.noop_hook,
        "torch_allreduce": default_hooks.allreduce_hook,
        "torch_fp16": default_hooks.fp16_compress_hook,
        "torch_bf16": default_hooks.bf16_compress_hook,
        # uint8 min-max codes of every rank, all-gathered (they fail on gloo: the row says so)
        "torch_quantize_per_tensor": quantization_hooks.quantization_pertensor_hook,
        "torch_quantize_per_channel": quantization_hooks.quantization_perchannel_hook,
    }
    ddp.register_comm_hook(None, simple[name])
    return lambda: None
