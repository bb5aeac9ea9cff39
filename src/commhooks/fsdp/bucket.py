"""Running the package's DDP hooks on the gradient shards of FSDP2 modules.

FSDP2 calls an all-reduce hook (``FSDPModule.set_all_reduce_hook``) with each module's flat
gradient shard, after the reduce-scatter within the machine. :class:`ShardHook` hands it to a
DDP hook as a :class:`ShardBucket` (``GradBucket``'s methods) and leaves the result in the
shard, before it returns or at the end of the backward pass (:mod:`.pending`).

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
    """One FSDP module's flat gradient shard (padding included), seen through ``GradBucket``'s
    methods; ``slots`` say where each parameter's shard lies in it."""

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
        """Each parameter's shard as a view into :meth:`buffer`: FSDP2 shards on dim 0, so an
        ``n x m`` weight's is ``rows x m`` (fewer rows on the last ranks, or none)."""
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
    """Finds the last hook call of each backward pass (a DDP bucket's ``is_last()``), on which
    stateful hooks count steps: FSDP2 reduces every module that has run a forward pass since it
    was built, so the pass ends when each module seen by a forward pre-hook has been called.
    ``names``: the hooked modules' names, by index, for messages."""

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
            RuntimeError: the module was called again before every other module was, or
                before its first forward pass: the step count would go wrong.
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

    FSDP2 calls it on the backward pass's thread, once per module and synchronising pass. On
    CPU, given ``pending`` (one rank per machine), where FSDP2 only makes the gradients views
    of the shard, it returns once the hook's collectives are issued and ``pending`` finishes
    them at the end of the pass, so communication overlaps the backward computation as DDP's
    buckets do. Otherwise it waits for the result, which FSDP2 uses as soon as it returns (on
    a GPU FSDP2 orders its work after the hook's with an event recorded then).

    ``steps`` and ``pending`` (``None``: always wait) are shared by the model's modules.
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
    """The parameters in ``module``'s gradient shard: those that require a gradient (all of
    them, with the ``set_reduce_scatter_unused_params(True)`` registration sets)."""
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
