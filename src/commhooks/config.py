"""One-line configuration: ``commhooks.register(ddp_model, "power_sgd", wrapper="fp16")``.

Names follow Hugging Face Accelerate's ``DDPCommunicationHookType`` (``no``, ``fp16``, ``bf16``,
``power_sgd``, ``batched_power_sgd``) plus the package's own. Everything is validated before
anything is registered: an unknown name or option, or an option that the chosen hook does not
take, raises ``ValueError`` listing what is valid.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch.distributed as dist

__all__ = ["CommHookType", "HookSpec", "register", "hook_spec"]


class CommHookType(str, Enum):
    """Names of the hooks and wrappers ``register`` understands (Accelerate's and ours)."""

    NO = "no"
    ALLREDUCE = "allreduce"
    FP16 = "fp16"
    BF16 = "bf16"
    NOOP = "noop"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"
    POWER_SGD_SINGLE_ROUND = "power_sgd_single_round"
    POST_LOCAL_SGD = "post_local_sgd"

    def __str__(self) -> str:
        return self.value


WRAPPERS = (CommHookType.NO, CommHookType.FP16, CommHookType.BF16)


@dataclass(frozen=True)
class HookSpec:
    """How to build and register one kind of hook.

    Attributes:
        hook: the hook function.
        make_state: builds the state from ``(process_group, options)``; ``None`` when the state
            is the process group itself.
        options: the option names ``make_state`` accepts.
    """

    hook: Callable[..., Any] | None
    make_state: Callable[[dist.ProcessGroup | None, dict[str, Any]], Any] | None = None
    options: frozenset[str] = field(default_factory=frozenset)


def _specs() -> dict[CommHookType, HookSpec]:
    # Imported here so that ``import commhooks.config`` stays cheap and cycle-free.
    from commhooks.hooks import (
        allreduce_hook,
        bf16_compress_hook,
        fp16_compress_hook,
        noop_hook,
    )

    return {
        CommHookType.NO: HookSpec(hook=None),
        CommHookType.ALLREDUCE: HookSpec(allreduce_hook),
        CommHookType.FP16: HookSpec(fp16_compress_hook),
        CommHookType.BF16: HookSpec(bf16_compress_hook),
        CommHookType.NOOP: HookSpec(noop_hook),
        **_powersgd_specs(),
    }


def _powersgd_specs() -> dict[CommHookType, HookSpec]:
    from commhooks.hooks.powersgd import (
        _OPTION_NAMES,
        PowerSGDState,
        batched_powerSGD_hook,
        powerSGD_hook,
    )

    def make(defaults: dict[str, Any]) -> Callable[..., PowerSGDState]:
        return lambda group, options: PowerSGDState(group, **{**defaults, **options})

    names = frozenset(_OPTION_NAMES)
    return {
        CommHookType.POWER_SGD: HookSpec(powerSGD_hook, make({}), names),
        CommHookType.BATCHED_POWER_SGD: HookSpec(batched_powerSGD_hook, make({}), names),
        CommHookType.POWER_SGD_SINGLE_ROUND: HookSpec(
            powerSGD_hook, make({"single_round": True}), names
        ),
    }


def parse_name(
    value: Any, what: str, allowed: tuple[CommHookType, ...] | None = None
) -> CommHookType:
    """Turn an enum member or its string into a ``CommHookType``, or explain what is valid."""
    valid = allowed or tuple(_specs())
    try:
        name = CommHookType(value.value if isinstance(value, Enum) else str(value).lower())
    except ValueError:
        name = None
    if name is None or name not in valid:
        raise ValueError(
            f"unknown {what} {value!r}; valid {what}s: {', '.join(v.value for v in valid)}."
        )
    return name


def hook_spec(hook: CommHookType | str) -> HookSpec:
    """The spec registered for ``hook``."""
    return _specs()[parse_name(hook, "hook")]


def register(
    ddp_model: Any,
    hook: CommHookType | str,
    wrapper: CommHookType | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> Any:
    """Build the state for ``hook`` from ``options``, wrap, register on ``ddp_model``.

    Args:
        ddp_model: a ``DistributedDataParallel`` model without a hook yet.
        hook: a ``CommHookType`` or its name (``"power_sgd"``...). ``"no"`` registers nothing.
        wrapper: ``None``/``"no"``, ``"fp16"`` or ``"bf16"``: run the hook on a down-cast bucket.
        process_group: the group to communicate on; ``None`` for the default group.
        **options: the hook's state options, e.g. ``matrix_approximation_rank=2``.

    Returns:
        the state object registered with the hook (keep it to checkpoint it), the process
        group for stateless hooks, or ``None`` when ``hook`` is ``"no"``.

    Raises:
        ValueError: unknown hook, wrapper or option, or an option the hook does not take.
    """
    kind = parse_name(hook, "hook")
    wrap = parse_name(wrapper or CommHookType.NO, "wrapper", WRAPPERS)
    spec = _specs()[kind]
    unknown = sorted(set(options) - spec.options)
    if unknown:
        valid = ", ".join(sorted(spec.options)) or "none"
        raise ValueError(
            f"option(s) {', '.join(unknown)} do not apply to hook '{kind}'; "
            f"options it takes: {valid}."
        )
    if kind is CommHookType.NO:
        if wrap is not CommHookType.NO:
            raise ValueError(
                f"wrapper '{wrap}' needs a hook to wrap; hook 'no' keeps DDP's own allreduce. "
                f"Use hook='allreduce', wrapper='{wrap}' (or hook='{wrap}')."
            )
        return None
    state = spec.make_state(process_group, options) if spec.make_state else process_group
    fn = spec.hook
    if wrap is not CommHookType.NO:
        from commhooks.hooks import bf16_compress_wrapper, fp16_compress_wrapper

        fn = (fp16_compress_wrapper if wrap is CommHookType.FP16 else bf16_compress_wrapper)(fn)
    ddp_model.register_comm_hook(state, fn)
    return state


def options_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The hook options in a config mapping (everything but ``hook``/``wrapper``)."""
    return {k: v for k, v in config.items() if k not in ("hook", "wrapper", "process_group")}
