"""Using commhooks with Hugging Face Accelerate (``accelerate launch``, CPU or GPU).

Accelerate builds the ``DistributedDataParallel`` model in ``accelerator.prepare``; register
the hook on that model afterwards, and register its state for checkpointing::

    from accelerate import Accelerator
    from commhooks.integrations.accelerate import register_hook

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register_hook(accelerator, model, "power_sgd", matrix_approximation_rank=2)
    ...
    accelerator.save_state("ckpt")   # includes every rank's hook state
    accelerator.load_state("ckpt")

Leave Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)`` unset: DDP accepts one
hook per model, and ``register_hook`` says so if one is already there.

Accelerate itself is not imported here; the accelerator is used through its public methods.
"""

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from commhooks._warnings import warn_once
from commhooks.config import CommHookType, HookConfig, register_from_config
from commhooks.integrations.checkpoint import PerRankState

__all__ = ["find_ddp", "prepare_with_hook", "register_hook"]


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` module inside what ``accelerator.prepare`` returned.

    ``prepare`` returns the DDP model itself, or a ``torch.compile`` wrapper around it.
    """
    found: nn.Module | None = model
    while found is not None:
        if isinstance(found, DistributedDataParallel):
            return found
        found = getattr(found, "_orig_mod", None)
    return None


def register_hook(
    accelerator: Any,
    model: nn.Module,
    hook: CommHookType | str,
    wrapper: CommHookType | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> Any:
    """Register ``hook`` on a model prepared by ``accelerator``; checkpoint its state.

    Stateful hooks' state is registered with ``accelerator.register_for_checkpointing`` through
    :class:`~commhooks.integrations.checkpoint.PerRankState`, so ``save_state`` keeps every
    rank's copy (Accelerate writes custom objects from the main process only). Call this in
    the same order on every run, as Accelerate requires of checkpointed objects.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the model returned by ``accelerator.prepare``.
        hook, wrapper, process_group, **options: as for :func:`commhooks.register`.

    Returns:
        what ``commhooks.register`` returns; ``None`` when Accelerate did not wrap the model
        in DDP (a single process has nothing to communicate).

    Raises:
        ValueError: anything ``commhooks.register`` rejects. Names and options are checked
            even with a single process, so a typo fails on the laptop, not on the cluster.
    """
    config = HookConfig(hook, wrapper, options)
    ddp = find_ddp(model)
    if ddp is None:
        if getattr(accelerator, "num_processes", 1) > 1:
            raise TypeError(
                f"register_hook expects the model returned by accelerator.prepare(...), which "
                f"is a DistributedDataParallel model with several processes; got "
                f"{type(model).__name__}. Pass the prepared model."
            )
        warn_once(
            "accelerate-single-process",
            "commhooks: Accelerate runs a single process, so the model is not wrapped in DDP "
            "and no communication hook is registered. (On CPU, `accelerate launch --cpu` starts "
            "one process whatever --num_processes says; start several with "
            "`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...`.)",
        )
        return None
    state = register_from_config(ddp, config, process_group)
    if hasattr(state, "state_dict") and hasattr(state, "load_state_dict"):
        accelerator.register_for_checkpointing(PerRankState(state, process_group))
    return state


def prepare_with_hook(
    accelerator: Any,
    model: nn.Module,
    hook: CommHookType | str,
    wrapper: CommHookType | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> tuple[nn.Module, Any]:
    """``accelerator.prepare(model)``, then :func:`register_hook`; returns ``(model, state)``.

    Prepare the optimizer and data loaders afterwards (or together, then use
    :func:`register_hook`).
    """
    prepared = accelerator.prepare(model)
    return prepared, register_hook(accelerator, prepared, hook, wrapper, process_group, **options)
