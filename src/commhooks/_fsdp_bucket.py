"""Running the package's DDP hooks on the gradient shards of FSDP2 modules.

FSDP2 calls an all-reduce hook (``FSDPModule.set_all_reduce_hook``) with each module's flat
gradient shard, right after the reduce-scatter within the machine, and reads the shard back as
soon as the hook returns. :class:`ShardHook` is that hook: it hands the shard to a DDP hook as a
:class:`ShardBucket`, an object with the methods of ``torch.distributed.GradBucket`` that the
package's hooks use, waits for the hook's result and leaves it in the shard. The DDP hooks and
their states are reused unchanged.

Hook-facing modules must not use ``from __future__ import annotations``.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from commhooks import comm
from commhooks._fsdp_layout import ShardSlot, managed_shards

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

    Stateful hooks count steps on that call; FSDP2 calls the hook of every module once per
    backward pass that synchronises, so the pass ends when every module has been called.

    Args:
        names: the hooked modules' names, by index, for messages.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._names = tuple(names)
        self._seen: set[int] = set()

    def arrive(self, index: int) -> bool:
        """Record module ``index``'s call; whether it completes the backward pass.

        Raises:
            RuntimeError: the module was called twice before every other one was: a module
                took no part in a backward pass, and the step count would go wrong.
        """
        if index in self._seen:
            missing = [self._names[i] for i in range(len(self._names)) if i not in self._seen]
            self._seen.clear()
            raise RuntimeError(
                f"commhooks.fsdp: FSDP module {self._names[index]} reduced its gradients again "
                f"before {', '.join(missing)} did. Every hooked FSDP module must take part in "
                "every backward pass (the hook counts optimizer steps by them): run each one in "
                "the forward pass, or leave modules that train only sometimes out of fully_shard."
            )
        self._seen.add(index)
        if len(self._seen) < len(self._names):
            return False
        self._seen.clear()
        return True


class ShardHook:
    """The hook given to ``FSDPModule.set_all_reduce_hook``: a DDP hook applied to the shard.

    FSDP2 calls it on the thread running the backward pass (on a GPU, inside FSDP2's all-reduce
    stream), once per module and synchronising backward pass. It waits for the DDP hook's
    future, since FSDP2 uses the shard as soon as the call returns: the collectives of one
    module's shard do not overlap the backward computation of the next.

    Args:
        module: the FSDP module.
        index: its number among the hooked modules.
        hook: a DDP communication hook, ``hook(state, bucket) -> Future[Tensor]``.
        state: the hook's state (a process group for the stateless hooks).
        steps: shared by every module of the model.
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        hook: Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"],
        state: Any,
        steps: StepTracker,
    ) -> None:
        self.module, self.index, self.hook, self.state, self.steps = (
            module,
            index,
            hook,
            state,
            steps,
        )

    def __call__(self, shard: torch.Tensor) -> None:
        slots = reduced_shards(self.module)
        _check_fits(shard, slots, self.module)
        bucket = ShardBucket(self.index, shard, slots, self.steps.arrive(self.index))
        with comm.unheld_follow_ups():
            averaged = self.hook(self.state, bucket).wait()
        if averaged is not shard:
            if averaged.numel() != shard.numel():
                raise RuntimeError(
                    f"commhooks.fsdp: the hook returned {averaged.numel()} elements for a shard "
                    f"of {shard.numel()}; a hook must return a tensor of its bucket's size."
                )
            shard.copy_(averaged.view_as(shard))


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
