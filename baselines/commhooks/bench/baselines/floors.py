"""Floors: what every hook of a kind pays, whatever its compression does.

A compressing hook is slower than ``noop`` for three reasons, and only the last one is
compression work. These hooks add them one at a time, so that a benchmark shows how much of a
hook's overhead any design would pay on the machine and network at hand:

``floor_sync``
    One one-element allreduce per bucket. Ranks that communicate wait, at every step, for the
    slowest of them, and run their memory-bound phases at the same moment; ``noop`` never does.
``floor_wire``
    The same, sending as many bytes as single-round PowerSGD sends at this step (the factor
    it alternates between, and the tensors it leaves uncompressed), at the same rank.
``floor_memory``
    The same, plus the memory passes of error feedback: the gradient is added into a memory
    of its size before the collective, and written over once after it with a rank-``r`` product
    ``P Qᵀ``. No factor is computed from the gradient and
    nothing is orthogonalised.

They are measuring instruments, not training hooks: the first two leave each rank with its own
gradient, as ``noop`` does, and ``floor_memory`` leaves a small fixed low-rank gradient, so their
held-out losses say nothing about any algorithm.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.compress import lowrank

__all__ = ["FLOOR_HOOKS", "FloorState", "attach_floor"]

FLOOR_HOOKS = ("floor_sync", "floor_wire", "floor_memory")


@dataclass
class FloorState:
    """Rank of the PowerSGD step being imitated, and what persists between steps."""

    matrix_approximation_rank: int = 2
    min_compression_rate: float = 2.0
    start_powerSGD_iter: int = 0  # PowerSGD's first P step; the parity of later steps
    steps: dict[int, int] = field(default_factory=dict)  # per bucket: calls so far
    memory: dict[int, torch.Tensor] = field(default_factory=dict)  # per bucket
    factors: dict[int, tuple] = field(default_factory=dict)  # per gradient: fixed (P, Qᵀ)


def _matrices(state: FloorState, bucket: dist.GradBucket) -> tuple[list, list]:
    """The bucket's gradients as PowerSGD splits them: (index, n, m, r) matrices, and the rest."""
    compressed, plain = [], []
    for i, grad in enumerate(bucket.gradients()):
        n, m = lowrank.as_matrix(grad).shape
        r = lowrank.effective_rank(n, m, state.matrix_approximation_rank)
        if lowrank.should_compress(n, m, r, state.min_compression_rate):
            compressed.append((i, n, m, r))
        else:
            plain.append(i)
    return compressed, plain


def payload_numel(state: FloorState, bucket: dist.GradBucket, step: int) -> int:
    """Elements single-round PowerSGD sends for ``bucket`` at its ``step``-th compressed step.

    Every matrix starts with a P step (``n x r``) and then alternates with Q steps (``m x r``);
    the tensors it does not compress are sent as they are.
    """
    compressed, plain = _matrices(state, bucket)
    grads = bucket.gradients()
    factors = sum((n if step % 2 == 0 else m) * r for _, n, m, r in compressed)
    return factors + sum(grads[i].numel() for i in plain)


def _payload(state: FloorState, bucket: dist.GradBucket) -> torch.Tensor:
    calls = state.steps.get(bucket.index(), 0)
    state.steps[bucket.index()] = calls + 1
    step = calls - state.start_powerSGD_iter  # before it, the same alternation
    buffer = bucket.buffer()
    size = min(payload_numel(state, bucket, step), buffer.numel())
    return buffer[:size].clone()


def floor_sync(state: FloorState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """One-element allreduce; each rank keeps its own gradient."""
    buffer = bucket.buffer()
    token = buffer.new_zeros(1)
    return comm.allreduce(token, dist.group.WORLD).then(lambda fut: buffer)


def floor_wire(state: FloorState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a payload the size of single-round PowerSGD's; each rank keeps its gradient."""
    buffer = bucket.buffer()
    return comm.average(_payload(state, bucket), dist.group.WORLD).then(lambda fut: buffer)


def floor_memory(state: FloorState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``floor_wire`` plus error feedback's passes: add into a memory, then write ``P Qᵀ``."""
    buffer = bucket.buffer()
    memory = state.memory.get(bucket.index())
    if memory is None or memory.shape != buffer.shape:
        memory = state.memory[bucket.index()] = torch.zeros_like(buffer)
    memory.add_(buffer)
    payload = _payload(state, bucket)
    compressed, _ = _matrices(state, bucket)

    def write(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()
        grads = bucket.gradients()
        for i, n, m, r in compressed:
            p, qt = _factors(state, i, n, m, r, buffer)
            torch.mm(p, qt, out=lowrank.as_matrix(grads[i]))
        return buffer

    return comm.average(payload, dist.group.WORLD).then(write)


def _factors(
    state: FloorState, i: int, n: int, m: int, r: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed small random factors for gradient ``i``: what is written costs, not its value."""
    factors = state.factors.get(i)
    if factors is None or factors[0].shape != (n, r) or factors[1].shape != (r, m):
        gen = torch.Generator().manual_seed(i)
        p = torch.randn(n, r, generator=gen).mul_(1e-3).to(like)
        qt = torch.randn(r, m, generator=gen).div_(m**0.5).to(like)
        factors = state.factors[i] = (p, qt)
    return factors


_HOOKS = {"floor_sync": floor_sync, "floor_wire": floor_wire, "floor_memory": floor_memory}


def attach_floor(ddp: Any, name: str, options: dict[str, Any]) -> None:
    """Register floor ``name`` on ``ddp`` with a fresh :class:`FloorState`."""
    allowed = {"matrix_approximation_rank", "min_compression_rate", "start_powerSGD_iter"}
    ddp.register_comm_hook(
        FloorState(**{k: v for k, v in options.items() if k in allowed}), _HOOKS[name]
    )
