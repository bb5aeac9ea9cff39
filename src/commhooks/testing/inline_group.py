"""A process group of one rank whose collectives complete as they are issued: NCCL's futures,
without a GPU.

NCCL runs a hook's callbacks at once, on the issuing thread; gloo runs them on a thread of its
own, which a hook pays for differently. A GPU's host cost is best measured on a backend that
behaves as NCCL does: this one, on a CPU, for PyTorch's hooks and ours alike
(``examples/host_cost.py --backend inline``, ours inside
:func:`commhooks.comm.completing_inline`).

    from commhooks.testing import inline_group
    inline_group.init()  # instead of init_process_group, in a process of its own

Not for training: nothing leaves the process.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

__all__ = ["BACKEND", "InlineGroup", "init"]

BACKEND = "inline"


def _finished(result: list[torch.Tensor]) -> Any:
    """A work whose future already holds ``result``, as NCCL's does once it is queued."""
    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class InlineGroup(dist.ProcessGroup):
    """One rank; each collective's result is its input, and its work is finished already
    (torch's stubs list only the callers' overloads, hence the ``override`` ignores)."""

    def getBackendName(self) -> str:  # noqa: N802 (the backend interface's name)
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return _finished(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _finished(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return _finished(tensors)

    def allgather(  # type: ignore[override]
        self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, tensor in zip(outs, ins):
            out[0].copy_(tensor)
        return _finished([t for out in outs for t in out])

    def _allgather_base(self, out: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        out.copy_(tensor.reshape(out.shape))
        return _finished([out])

    def all_gather_single(self, out: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(out, tensor, opts)

    def barrier(self, opts: Any = None) -> Any:
        return _finished([])


def _create(store: Any, rank: int, size: int, timeout: Any) -> InlineGroup:
    if size != 1:
        raise ValueError(f"the {BACKEND!r} backend has one rank; got world_size={size}.")
    return InlineGroup(rank, size)  # type: ignore[call-arg]


def init() -> None:
    """``init_process_group`` on this backend: one rank, an in-memory store."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)
