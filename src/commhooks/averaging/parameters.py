"""Parameter averaging, and the parameters an averager averages, named.

:func:`average_parameters` and :func:`get_params_to_average` behave as PyTorch's functions of
the same names (``torch.distributed.algorithms.model_averaging.utils``): the first averages
every parameter it is given, the second picks those that have a gradient, which is what the
averagers average. Averagers keep their state per parameter *name*, so this module also says
what a parameter is called: its name in ``model.named_parameters()`` when known, else its
place in the optimizer's parameter groups (``"<group>.<index>"``), else its position.
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.compress.lowrank import views_like

__all__ = [
    "Named",
    "Params",
    "average_parameters",
    "get_params_to_average",
    "named_in_groups",
    "positional",
]

Params = Iterable[torch.Tensor] | Iterable[Mapping[str, Any]]
Named = list[tuple[str, torch.Tensor]]
"""Parameters with their names, in a fixed order (the order every rank averages them in)."""


def _entries(params: Params) -> Iterable[torch.Tensor]:
    for entry in params:
        group = entry["params"] if isinstance(entry, Mapping) else [entry]
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    "pass model.parameters() or optimizer.param_groups; got an entry of type "
                    f"{type(p).__name__}."
                )
            yield p


def get_params_to_average(params: Params) -> list[torch.Tensor]:
    """The parameters that have a gradient, from ``model.parameters()`` or ``param_groups``, as
    PyTorch's function: every rank must agree on which have one."""
    return [p for p in _entries(params) if p.grad is not None]


def average_parameters(params: Params, process_group: dist.ProcessGroup | None = None) -> None:
    """Average every parameter given across ``process_group``, in place.

    As PyTorch's function: with or without a gradient (filter with
    :func:`get_params_to_average`), and nothing on a rank outside the group. One allreduce of a
    flat copy, not one a layer; each parameter keeps its dtype.

    Args:
        params: ``model.parameters()``, a list of tensors, or ``optimizer.param_groups``.
        process_group: the group to average over; ``None`` for the default group.
    """
    if comm.excludes_this_rank(process_group):
        return
    tensors = list(_entries(params))
    group = comm.resolve_group(process_group, owner="average_parameters")
    if not tensors or comm.world_size(group) == 1:
        return
    with torch.no_grad():
        for p, avg in zip(tensors, averaged_views(tensors, group)):
            p.copy_(avg)


def averaged_views(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The average over ``group`` of each of ``tensors``, as views of one flat buffer of their
    widest dtype (one blocking allreduce)."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return views_like(comm.average(flat, group).wait(), tensors)


def positional(tensors: Sequence[torch.Tensor]) -> Named:
    """Name tensors by their position (``"0"``, ``"1"``...), where no better name is known."""
    return [(str(i), t) for i, t in enumerate(tensors)]


def named_in_groups(
    param_groups: Sequence[Mapping[str, Any]],
    names: Mapping[int, str] | None = None,
    with_grad_only: bool = True,
) -> Named:
    """The parameters of an optimizer's ``param_groups`` that have a gradient (all, without
    ``with_grad_only``), named by ``names`` (by ``id``, from ``named_parameters()``), else by
    the group's ``"param_names"``, else ``"<group>.<index>"``."""
    out: Named = []
    for g, group in enumerate(param_groups):
        given = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if with_grad_only and p.grad is None:
                continue
            name = (names or {}).get(id(p))
            if name is None:
                name = str(given[i]) if given and i < len(given) else f"{g}.{i}"
            out.append((name, p))
    return out
