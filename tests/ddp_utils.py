"""Small models, data and training loops shared by the multi-rank tests.

Everything here runs inside a rank started by ``commhooks.testing.run_on_ranks``, except
:func:`free_port`, for tests that start rank processes of their own.
"""

import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

IN, OUT = 32, 8


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_mlp(seed: int = 0, widths: Sequence[int] = (IN, 64, 64, 32, OUT)) -> nn.Sequential:
    """An MLP whose layers are large enough to be compressed and to fill several buckets."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_ddp(
    model: nn.Module,
    hook: Callable | None = None,
    state: Any = None,
    bucket_cap_mb: float = 0.004,
    **ddp_kwargs: Any,
) -> DDP:
    """Wrap ``model`` in DDP with small buckets (several per model) and register ``hook``."""
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp


def streaming_diloco(ddp: DDP, lr: float = 0.05) -> tuple[torch.optim.Optimizer, Any]:
    """Streaming DiLoCo with every part in use, registered on ``ddp`` and attached to a new SGD
    inner optimizer: an int8 warm-up of 2 steps, then 2 int4 fragments synced every 4 steps,
    each applied one step after it is issued, the step taken meanwhile kept."""
    import commhooks

    diloco = commhooks.register(
        ddp, "streaming_diloco", sync_every=4, fragments=2, fragment_sync_delay=1,
        warmup_steps=2, warmup_bits=8, bits=4, keep_inflight_steps=True,
    )  # fmt: skip
    inner = torch.optim.SGD(ddp.parameters(), lr=lr)
    diloco.attach(inner, ddp.module.named_parameters())
    return inner, diloco


def batches(
    rank: int, steps: int, seed: int = 1, batch: int = 16, same_on_all_ranks: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic regression data, different on each rank unless asked otherwise."""
    gen = torch.Generator().manual_seed(seed * 1000 + (0 if same_on_all_ranks else rank))
    out = []
    for _ in range(steps):
        x = torch.randn(batch, IN, generator=gen)
        y = torch.randn(batch, OUT, generator=gen)
        out.append((x, y))
    return out


def train(
    ddp: nn.Module,
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 0.05,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[float]:
    """Plain SGD on MSE; returns the losses."""
    opt = optimizer or torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the exception it raised as ``"Type: message"``, then a barrier.

    For running several cases in one launch: each rank records what it saw, and the barrier
    keeps the ranks together before the next case (a failure on both ranks alike leaves the
    group usable).
    """
    try:
        result = fn()
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return result


def count_gathers(
    step: Callable[[torch.Tensor, torch.Tensor], Any],
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[int]:
    """How many ``all_gather_object`` calls (the one-off cross-rank checks) each step makes."""
    calls: list[int] = []
    original = dist.all_gather_object

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_gather_object = counting
    try:
        per_step = []
        for x, y in data:
            before = len(calls)
            step(x, y)
            per_step.append(len(calls) - before)
    finally:
        dist.all_gather_object = original
    return per_step


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values to the host (``.item()``, ``bool(t)``, ``float(t)``:
    each is one ``aten._local_scalar_dense``) in the thread it is entered in, on any device:
    what a GPU's host would wait for."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])


def count_buckets(hook: Callable) -> tuple[Callable, set[int]]:
    """Wrap ``hook`` so that the bucket indices it sees are recorded."""
    seen: set[int] = set()

    def counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.add(bucket.index())
        return hook(state, bucket)

    return counting_hook, seen


class FakeBucket:
    """Enough of ``dist.GradBucket`` to call a hook directly on a tensor of our choosing."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        index: int = 0,
        last: bool = True,
        device: torch.device | str = "cpu",
    ):
        self._shapes = [t.shape for t in tensors]
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
        self._buffer = flat.to(device)
        self._params = [torch.zeros(s) for s in self._shapes]
        self._index, self._last = index, last

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def set_last(self, last: bool) -> None:
        """Make this the step's last bucket, or not (DDP's next step: the same parameters)."""
        self._last = last

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in self._shapes:
            n = shape.numel()
            out.append(self._buffer[offset : offset + n].view(shape))
            offset += n
        return out


def resume_with_absurd_memory(
    rank: int, world_size: int, hook: str, options: dict[str, Any], value: float = 1e6
) -> dict[str, Any]:
    """Train 4 steps with ``hook``, save its state; rank 0 fills its error memories with
    ``value``; rebuild from the saved model and state and train 4 more steps.

    Returns the losses after the reload, whether the parameters stayed finite, and the
    messages of the warnings raised meanwhile.
    """
    import warnings

    import commhooks

    model = make_mlp()
    ddp = make_ddp(model)
    state = commhooks.register(ddp, hook, **options)
    data = batches(rank, 8)
    train(ddp, data[:4])
    saved = state.state_dict()
    memories = [name for name in ("error", "owner_error") if name in saved]
    if rank == 0:
        for name in memories:
            saved[name] = {k: torch.full_like(t, value) for k, t in saved[name].items()}
    again = make_mlp()
    again.load_state_dict(model.state_dict())
    ddp = make_ddp(again)
    state = commhooks.register(ddp, hook, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.load_state_dict(saved)
        losses = train(ddp, data[4:])
    finite = all(bool(torch.isfinite(p).all()) for p in again.parameters())
    parts = [getattr(state, n) for n in ("error", "owner_error", "memory") if hasattr(state, n)]
    return {
        "losses": losses,
        "finite": finite,
        "keys": sorted(k for name in memories for k in saved[name]),
        "warnings": [str(w.message) for w in caught],
        "still_checking": any(part.awaits_check for part in parts),
    }


def resume_with_the_first_layer_frozen(
    rank: int, world_size: int, hook: str, options: dict[str, Any]
) -> dict[str, Any]:
    """Train 3 steps with ``hook``, save its state; load it into the same model with its first
    layer frozen (parameters #6 and #7, counted from DDP's last) and train 3 steps."""
    import warnings

    import commhooks

    ddp = make_ddp(make_mlp())
    state = commhooks.register(ddp, hook, **options)
    train(ddp, batches(rank, 3))
    saved = state.state_dict()
    model = make_mlp()
    model[0].requires_grad_(False)
    ddp = make_ddp(model)
    state = commhooks.register(ddp, hook, **options)
    state.load_state_dict(saved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(ddp, batches(rank, 3))
    parts = [getattr(state, n) for n in ("error", "owner_error", "memory") if hasattr(state, n)]
    return {
        "saved": sorted(saved["error"]),
        "kept": sorted(state.state_dict()["error"]),
        "factors": sorted(state.state_dict().get("q", {})),
        "checking": any(part.awaits_check for part in parts),
        "warnings": [str(w.message) for w in caught],
    }


def resume_each_with_absurd_memory(
    rank: int, world_size: int, cases: Sequence[tuple[str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """:func:`resume_with_absurd_memory` for each ``(hook, options)``, in one launch."""
    return [resume_with_absurd_memory(rank, world_size, h, o) for h, o in cases]
