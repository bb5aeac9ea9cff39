"""Running the package's DDP hooks on the gradient shards of FSDP2 modules.

FSDP2 calls an all-reduce hook (``FSDPModule.set_all_reduce_hook``) with each module's flat
gradient shard, right after the reduce-scatter within the machine. :class:`ShardHook` is that
hook: it hands the shard to a DDP hook as a :class:`ShardBucket`, an object with the methods of
``torch.distributed.GradBucket`` that the package's hooks use, and leaves the hook's result in
the shard, either before it returns or, where FSDP2 only makes the gradients views of the
shard, at the end of the backward pass (``_fsdp_pending``). The DDP hooks and their states are
reused unchanged.

Hook-facing modules must not use ``from __future__ import annotations``.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from commhooks.fsdp.layout import ShardSlot, managed_shards, shard_becomes_gradients
from commhooks.fsdp.pending import PendingShards, place
from commhooks.hooks.repair import deciding_each_bucket

__all__ = ["ShardBucket", "ShardHook", "StepTracker"]


class ShardBucket:
    """One FSDP module's flat gradient shard, seen through ``GradBucket``'s methods.

    Args:
        index: the module's number among the hooked modules (stable across steps and runs).
        buffer: the flat shard, padding included; the hook's result is expected in it.
        slots: where each parameter's shard lies in ``buffer``.
        last: whether this is the last shard of the backward pass.
    """

    def __init__(
        self, index: int, buffer: torch.Tensor, slots: Sequence[ShardSlot], last: bool
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._slots = tuple(slots)
        self._last = last

    def index(self) -> int:
        """The module's number: the same for the same module in every step."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient shard, padding included (the padding is zero on every rank)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's shard as a view into :meth:`buffer`, padding excluded.

        FSDP2 shards on dim 0, so the shard of an ``n x m`` weight is ``rows x m``; ``rows`` may
        be smaller on the last ranks of a machine, or 0.
        """
        views, offset = [], 0
        for slot in self._slots:
            views.append(self._buffer[offset : offset + slot.shape.numel()].view(slot.shape))
            offset += slot.span
        return views

    def parameters(self) -> list[torch.Tensor]:
        """The sharded parameters, in the order of :meth:`gradients`; the same objects each step."""
        return [slot.param for slot in self._slots]

    def is_last(self) -> bool:
        """Whether this is the backward pass's last shard: true once per step, as in DDP."""
        return self._last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the flat shard (a cast wrapper does), keeping the layout."""
        if buffer.shape != self._buffer.shape:
            raise ValueError(
                f"set_buffer needs a tensor of the shard's shape {tuple(self._buffer.shape)}, "
                f"got {tuple(buffer.shape)}."
            )
        self._buffer = buffer


class StepTracker:
    """Finds the last hook call of each backward pass, which a DDP bucket reports as ``is_last()``.

    Stateful hooks count steps on that call. FSDP2 reduces, in every backward pass that
    synchronises, each FSDP module that has run a forward pass since it was built (one that did
    not run in this step's forward reduces zeros), so the pass ends when every module seen in
    a forward pass has been called. Modules are watched with forward pre-hooks.

    Args:
        names: the hooked modules' names, by index, for messages.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._names = tuple(names)
        self._ran: set[int] = set()
        self._seen: set[int] = set()

    def watch(self, module: nn.Module, index: int) -> None:
        """Note module ``index`` as taking part from its first forward pass on."""
        module.register_forward_pre_hook(lambda _module, _args: self._ran.add(index))

    def arrive(self, index: int) -> bool:
        """Record module ``index``'s call; whether it completes the backward pass.

        Raises:
            RuntimeError: the module was called twice before every other module that has run
                was called once, or before it ran a forward pass: the step count would go wrong.
        """
        if index in self._seen or index not in self._ran:
            raise self._out_of_turn(index)
        self._seen.add(index)
        if self._seen != self._ran:
            return False
        self._seen.clear()
        return True

    def _out_of_turn(self, index: int) -> RuntimeError:
        if index in self._ran:
            missing = ", ".join(self._names[i] for i in sorted(self._ran - self._seen))
            what = f"twice before {missing} reduced once"
        else:
            what = "before it ran a forward pass"
        self._seen.clear()
        return RuntimeError(
            f"commhooks.fsdp: FSDP module {self._names[index]} reduced its gradients {what}. The "
            "hook counts optimizer steps by the backward passes in which every FSDP module that "
            "has run reduces once: turn gradient synchronisation on and off for the whole model "
            "(model.set_requires_gradient_sync(...) on the root, which recurses)."
        )


class ShardHook:
    """The hook given to ``FSDPModule.set_all_reduce_hook``: a DDP hook applied to the shard.

    FSDP2 calls it on the thread running the backward pass (on a GPU, inside FSDP2's all-reduce
    stream), once per module and synchronising backward pass. On CPU, given ``pending`` (one
    rank per machine), where FSDP2 makes the gradients views of the shard and reads none of
    it, the call returns once the DDP hook has issued its collectives, and ``pending``
    finishes them at the end of the backward pass, so that one module's communication
    overlaps the next modules' backward computation, as DDP's buckets do. Otherwise (a cast,
    an accumulation, a post-accumulate-grad hook, a GPU, several ranks per machine) it waits
    for the result, which FSDP2 uses as soon as the call returns. On a GPU FSDP2 orders its
    own work after the hook's with an event recorded when the call returns, which work
    finished later would escape.

    Args:
        module: the FSDP module.
        index: its number among the hooked modules.
        hook: a DDP communication hook, ``hook(state, bucket) -> Future[Tensor]``.
        state: the hook's state (a process group for the stateless hooks).
        steps: shared by every module of the model.
        pending: shared by every module of the model; ``None``: always wait.
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        hook: Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"],
        state: Any,
        steps: StepTracker,
        pending: PendingShards | None,
    ) -> None:
        self.module = module
        self.index = index
        self.hook = hook
        self.state = state
        self.steps = steps
        self.pending = pending

    def __call__(self, shard: torch.Tensor) -> None:
        slots = reduced_shards(self.module)
        _check_fits(shard, slots, self.module)
        pending = self.pending if shard.device.type == "cpu" else None
        if pending is not None and not shard_becomes_gradients(self.module, shard, slots):
            pending = None
        bucket = ShardBucket(self.index, shard, slots, self.steps.arrive(self.index))
        with deciding_each_bucket():
            averaging = self.hook(self.state, bucket)
            if pending is None or not pending.add(shard, averaging):
                place(shard, averaging.wait())


def reduced_shards(module: nn.Module) -> list[ShardSlot]:
    """The parameters in ``module``'s gradient shard: those that require a gradient.

    FSDP2 leaves out parameters without a gradient unless told to reduce them as zeros
    (``set_reduce_scatter_unused_params(True)``, which registration sets), so this holds for
    every backward pass, on every rank.
    """
    return [slot for slot in managed_shards(module) if slot.param.requires_grad]


def _check_fits(shard: torch.Tensor, slots: Sequence[ShardSlot], module: nn.Module) -> None:
    expected = sum(slot.span for slot in slots)
    if shard.dim() != 1 or shard.numel() != expected:
        raise RuntimeError(
            f"commhooks.fsdp: FSDP2 handed the all-reduce hook of {type(module).__name__} a "
            f"gradient shard of shape {tuple(shard.shape)}, where its parameters that require a "
            f"gradient take {expected} elements. Register with commhooks.fsdp.register, leave "
            "set_reduce_scatter_unused_params on, and keep requires_grad as it was at the first "
            "step."
        )
