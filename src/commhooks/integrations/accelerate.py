"""Using commhooks with Hugging Face Accelerate (``accelerate launch``, CPU or GPU).

The way Accelerate's own documentation chooses a DDP communication hook, with commhooks'
hooks: change the import of ``DistributedDataParallelKwargs`` and nothing else::

    from accelerate import Accelerator
    from commhooks.integrations.accelerate import DistributedDataParallelKwargs, hook_state
    from commhooks.integrations.checkpoint import PerRankState

    kwargs = DistributedDataParallelKwargs(
        comm_hook="power_sgd", comm_wrapper="fp16", comm_state_option={"start_powerSGD_iter": 10}
    )
    accelerator = Accelerator(kwargs_handlers=[kwargs])
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(PerRankState(hook_state(model)))

Or register on the model ``accelerator.prepare`` returned, which also registers the state for
checkpointing::

    from commhooks.integrations.accelerate import register_hook

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register_hook(accelerator, model, "power_sgd", matrix_approximation_rank=2)
    ...
    accelerator.save_state("ckpt")   # includes every rank's hook state
    accelerator.load_state("ckpt")

Use one or the other: DDP accepts one hook per model, and both say so if one is already there.
Accelerate is imported only by :func:`DistributedDataParallelKwargs`; otherwise the
accelerator is used through its public methods.
"""

import importlib
import weakref
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from commhooks._warnings import warn_once
from commhooks.config import CommHookType, HookConfig, register_from_config
from commhooks.integrations.checkpoint import PerRankState
from commhooks.state import StatelessState

__all__ = [
    "DistributedDataParallelKwargs",
    "find_ddp",
    "hook_state",
    "register_hook",
]

# The state registered on each DDP model that Accelerate prepared with one of our handlers.
_states: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
# What a handler of ours holds besides Accelerate's fields; never DDP arguments.
_OVERRIDES = ("register_comm_hook", "to_dict")
_ACCELERATE_KEYS = ("comm_hook", "comm_wrapper", "comm_state_option")


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` model ``accelerator.prepare`` returned, or the one inside
    its ``torch.compile`` wrapper."""
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

    ``model`` is the one ``accelerator.prepare`` returned; ``hook``, ``wrapper``,
    ``process_group`` and ``options`` are :func:`commhooks.register`'s.

    Returns:
        what ``commhooks.register`` returns (a stateless hook's ``StatelessState`` is not
        registered for checkpointing: it holds nothing); ``None`` when Accelerate did not wrap
        the model in DDP (a single process has nothing to communicate).

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
    if not isinstance(state, StatelessState):  # nothing to save for a stateless hook
        accelerator.register_for_checkpointing(PerRankState(state, process_group))
    return state


def DistributedDataParallelKwargs(  # noqa: N802  # stands in for Accelerate's class of that name
    comm_hook: Any = CommHookType.NO,
    comm_wrapper: Any = CommHookType.NO,
    comm_state_option: Mapping[str, Any] | None = None,
    **ddp_args: Any,
) -> Any:
    """Accelerate's ``DistributedDataParallelKwargs``, registering commhooks' hook.

    Accelerate looks its handlers up by their exact class, so this returns an instance of its
    own class, whose ``register_comm_hook`` (called by ``accelerator.prepare``) registers the
    commhooks hook instead of PyTorch's; the state is :func:`hook_state` of the prepared model.

    Args:
        comm_hook: any name ``commhooks.register`` takes (``"power_sgd"``, ``"bf16"``,
            ``"post_local_sgd"``...), or a member of Accelerate's ``DDPCommunicationHookType``.
        comm_wrapper: ``"no"``, ``"fp16"`` or ``"bf16"``.
        comm_state_option: the hook's options, e.g. ``{"matrix_approximation_rank": 2}``.
        **ddp_args: ``DistributedDataParallel`` arguments Accelerate's handler takes
            (``bucket_cap_mb``, ``find_unused_parameters``...).

    Raises:
        ValueError: an unknown hook, wrapper or option, or an option the hook does not take,
            now rather than in ``prepare``.
        TypeError: an argument Accelerate's handler does not take.
        ImportError: Accelerate is not installed.
    """
    config = HookConfig(comm_hook, comm_wrapper, dict(comm_state_option or {}))
    handler = _accelerate_handler(ddp_args)
    handler.comm_hook, handler.comm_wrapper = config.hook, config.wrapper
    handler.comm_state_option = dict(config.options)
    own_dict = type(handler).to_dict

    def register_comm_hook(model: nn.Module) -> None:
        _states[model] = register_from_config(model, config)

    def to_dict(ignore_keys: tuple[str, ...] = _ACCELERATE_KEYS) -> dict[str, Any]:
        kept = own_dict(handler, ignore_keys)
        return {k: v for k, v in kept.items() if k not in _OVERRIDES}

    # Instance attributes, found before the class's methods: Accelerate calls both on the
    # handler itself. Plain functions, so that Accelerate's deep copy of the fields keeps them.
    vars(handler).update(register_comm_hook=register_comm_hook, to_dict=to_dict)
    return handler


def _accelerate_handler(ddp_args: dict[str, Any]) -> Any:
    try:
        utils: Any = importlib.import_module("accelerate.utils")
    except ImportError as exc:
        raise ImportError(
            "DistributedDataParallelKwargs needs Accelerate: pip install accelerate "
            "(or pip install 'commhooks[accelerate]')."
        ) from exc
    kwargs_class = utils.DistributedDataParallelKwargs
    for key in ddp_args:
        if key in _ACCELERATE_KEYS or key not in kwargs_class.__dataclass_fields__:
            valid = [k for k in kwargs_class.__dataclass_fields__ if k not in _ACCELERATE_KEYS]
            raise TypeError(
                f"DistributedDataParallelKwargs got an unexpected argument '{key}'; the DDP "
                f"arguments it takes: {', '.join(valid)}."
            )
    return kwargs_class(**ddp_args)


def hook_state(model: nn.Module) -> Any:
    """The hook state registered on ``model`` (what ``accelerator.prepare`` returned) through
    :func:`DistributedDataParallelKwargs`, to register for checkpointing in ``PerRankState``;
    ``None`` without one (a single process: Accelerate does not wrap the model in DDP)."""
    ddp = find_ddp(model)
    return _states.get(ddp) if ddp is not None else None
