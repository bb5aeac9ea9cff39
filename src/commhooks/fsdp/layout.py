"""Where each parameter's gradient lies in the flat shard that FSDP2 hands to an all-reduce hook.

FSDP2 offers no public way to ask which parameters an FSDP module manages, in which order, or
how much room each takes in its reduce-scatter output; :func:`managed_shards` reads them from
FSDP2's internals, and is the only place in the package that does. What it relies on, checked
against torch 2.13 (``torch/distributed/fsdp/_fully_shard``):

* ``module._get_fsdp_state()._fsdp_param_groups`` holds one group (``set_all_reduce_hook``
  refuses modules with several), whose ``fsdp_params`` list the managed parameters in the order
  the reduce-scatter output concatenates them (``foreach_reduce``).
* Each ``FSDPParam`` has ``sharded_param`` (the ``nn.Parameter`` the optimizer sees, a
  ``DTensor``), ``sharded_size`` (this rank's shard, padding excluded; 0 rows where a short
  parameter left this rank nothing) and ``padded_sharded_param_size`` (every rank's padded
  shard). Each parameter occupies its padded size in the output, its shard first, then padding.
* Only parameters with a gradient are in the output; with ``set_reduce_scatter_unused_params
  (True)`` that is every parameter that requires one.
* After the hook returns, ``foreach_reduce`` divides the shard in place only for float16 or
  when the group's ``force_sum_reduction_for_comms`` is set, casts it (a copy) only when its
  dtype is not the parameters', adds it into gradients that exist already, and calls the
  parameters' ``_post_accumulate_grad_hooks``; otherwise each parameter's new gradient is a
  view of the shard, read by nobody before the optimizer (see :func:`shard_becomes_gradients`).

Anything else raises :class:`FSDPLayoutError` naming this module, rather than misreading a shard.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["FSDPLayoutError", "ShardSlot", "managed_shards", "shard_becomes_gradients"]

CHECKED_WITH = "2.13"


class FSDPLayoutError(RuntimeError):
    """This PyTorch's FSDP2 is not laid out as commhooks.fsdp expects."""


@dataclass(frozen=True)
class ShardSlot:
    """One parameter's place in the flat gradient shard: the sharded parameter, this rank's
    shard's shape (padding excluded), and the elements it spans (padding included)."""

    param: nn.Parameter
    shape: torch.Size
    span: int


def managed_shards(module: nn.Module) -> list[ShardSlot]:
    """The parameters FSDP module ``module`` manages, in the order of its gradient shard.

    Raises:
        FSDPLayoutError: FSDP2's internals are not what this function was written against.
    """
    try:
        groups = list(module._get_fsdp_state()._fsdp_param_groups)  # type: ignore[operator]
        if len(groups) > 1:
            raise FSDPLayoutError(
                f"{type(module).__name__} has {len(groups)} parameter groups (a per-parameter "
                "mesh from shard_placement_fn); FSDP2's all-reduce hook, which commhooks.fsdp "
                "relies on, takes modules with one group only."
            )
        return [_slot(p) for group in groups for p in group.fsdp_params]
    except AttributeError as exc:
        raise FSDPLayoutError(
            f"commhooks.fsdp reads the layout of FSDP2's gradient shards from its internals, as "
            f"of torch {CHECKED_WITH}, and this torch ({torch.__version__}) differs: {exc}. Use "
            f"torch {CHECKED_WITH}, or a commhooks release that supports this one."
        ) from exc


def _slot(fsdp_param: Any) -> ShardSlot:
    param = fsdp_param.sharded_param
    shape = torch.Size(fsdp_param.sharded_size)
    span = torch.Size(fsdp_param.padded_sharded_param_size).numel()
    if not isinstance(param, nn.Parameter) or shape.numel() > span:
        raise FSDPLayoutError(
            f"an FSDP2 parameter of shard {tuple(shape)} claims {span} elements of the gradient "
            f"shard; commhooks.fsdp was written against torch {CHECKED_WITH}'s layout, and this "
            f"torch ({torch.__version__}) differs."
        )
    return ShardSlot(param, shape, span)


def shard_becomes_gradients(module: nn.Module, shard: torch.Tensor, slots: list[ShardSlot]) -> bool:
    """Whether FSDP2 will only make the parameters' gradients views of ``shard``, so that the
    hook may finish averaging it later: not where it would divide, cast or add the shard, or
    hand it to a post-accumulate-grad hook, nor where its internals are not as described."""
    if shard.dtype not in (torch.float32, torch.bfloat16):  # float16 is divided after the hook
        return False
    try:
        (group,) = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
        if group.force_sum_reduction_for_comms:
            return False
    except (AttributeError, ValueError):
        return False
    return all(_untouched(slot.param, shard) for slot in slots)


def _untouched(param: nn.Parameter, shard: torch.Tensor) -> bool:
    return (
        param.grad is None
        and param.dtype == shard.dtype
        and param.device == shard.device
        and not getattr(param, "_post_accumulate_grad_hooks", None)
    )
