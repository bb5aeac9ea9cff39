"""Where a hook reads a value back to the host, counted on the CPU as on a GPU.

On a GPU a read (``.item()``, ``bool(tensor)``, ``float(tensor)``) makes the host wait until
the device has caught up. Every such read goes through one operator,
``aten._local_scalar_dense``, which a dispatch mode sees on any device. Under
:func:`commhooks.comm.completing_inline` collectives complete as NCCL's do, so every callback
runs inside the backward pass, on its thread: counting that operator there shows what a GPU's
host would wait for in a whole step.

* With their defaults, no hook reads anything, whether the step's gradients are finite or not:
  a non-finite gradient gives the non-finite average plain allreduce gives, and the memories
  are protected on the device.
* With ``on_nonfinite="repair"``, exactly one read a step: the batched check at the last bucket.
* On machines of several ranks the quantized hooks take two hops, and read nothing either,
  completing as NCCL's collectives do with gloo's bits.
* A scaler-style loop that skips the steps whose gradients are not finite: after one injected
  ``inf``, every later step is finite again, for every hook (no memory was poisoned).
"""

import contextlib
import os
from typing import Any

import pytest
import torch
from ddp_utils import batches, flat_params, make_ddp, make_mlp
from torch.utils._python_dispatch import TorchDispatchMode

import commhooks
from commhooks import comm
from commhooks.testing import run_on_ranks

_READ = torch.ops.aten._local_scalar_dense.default
_MANY_BUCKETS = (32,) + (8,) * 20  # 20 layers: 40 buckets, one a parameter
_POWER = {"start_powerSGD_iter": 2}

# name: (hook, wrapper, options), as ``commhooks.register`` takes them.
HOOKS: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "allreduce": ("allreduce", None, {}),
    "fp16": ("fp16", None, {}),
    "bf16": ("bf16", None, {}),
    "fp16_wrapper": ("power_sgd", "fp16", _POWER),
    "bf16_wrapper": ("allreduce", "bf16", {}),
    "power_sgd": ("power_sgd", None, _POWER),
    "single_round": ("power_sgd_single_round", None, _POWER),
    "batched": ("batched_power_sgd", None, _POWER),
    "int8": ("int8", None, {}),
    "int4": ("int4", None, {}),
    "packed_int4": ("int4", None, {"packed": True}),
    "post_local_sgd": ("post_local_sgd", None, {"start_localSGD_iter": 2}),
    # DiLoCo's hooks, in their warm-up (the averager is not attached: every step is one).
    "diloco_int8_warmup": ("diloco", None, {"sync_every": 2, "warmup_steps": 99, "warmup_bits": 8}),
    "streaming_diloco": ("streaming_diloco", None, {"sync_every": 2, "warmup_steps": 99}),
}
REPAIRABLE = [name for name in HOOKS if "diloco" not in name and name != "post_local_sgd"]


class _Reads(TorchDispatchMode):
    """Counts the reads to the host of tensor values, in the thread it is entered in."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _READ:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _model(name: str, policy: str | None) -> tuple[Any, dict[str, bool]]:
    """A DDP model of many buckets with hook ``name``; rank 0's first weight gets an ``inf``
    in its gradient while ``poison["now"]`` is set."""
    hook, wrapper, options = HOOKS[name]
    ddp = make_ddp(make_mlp(widths=_MANY_BUCKETS), bucket_cap_mb=0.00001)
    extra = {} if policy is None else {"on_nonfinite": policy}
    commhooks.register(ddp, hook, wrapper=wrapper, **options, **extra)
    poison = {"now": False}

    def inject(grad: torch.Tensor) -> torch.Tensor:
        if not poison["now"] or torch.distributed.get_rank() != 0:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    ddp.module[0].weight.register_hook(inject)
    return ddp, poison


def _step(ddp: Any, batch: tuple[torch.Tensor, torch.Tensor], reads: _Reads | None) -> None:
    x, y = batch
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    if reads is None:
        loss.backward()
        return
    with reads:  # the backward pass, every hook call and (inline) every callback in it
        loss.backward()


def _reads_in_a_step(rank: int, world_size: int, names: list[str], policy: str | None) -> dict:
    out = {}
    for name in names:
        ddp, poison = _model(name, policy)
        data = batches(rank, 5)
        with comm.completing_inline():
            for batch in data[:3]:  # past the handshake, DDP's rebuild and the warm-ups
                ddp.zero_grad(set_to_none=True)
                _step(ddp, batch, None)
            counts = []
            for bad, batch in zip((False, True), data[3:]):
                poison["now"] = bad
                ddp.zero_grad(set_to_none=True)
                reads = _Reads()
                _step(ddp, batch, reads)
                finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
                counts.append((reads.count, finite))
        out[name] = counts
    return out


@pytest.mark.timeout(150)
def test_no_hook_reads_anything_back_in_a_step_with_its_defaults():
    for out in run_on_ranks(_reads_in_a_step, 2, list(HOOKS), None, timeout=140):
        for name, ((finite_reads, finite), (bad_reads, bad_finite)) in out.items():
            assert finite and not bad_finite, name  # the inf reached every rank's gradient
            assert (finite_reads, bad_reads) == (0, 0), name


@pytest.mark.timeout(150)
def test_the_repair_reads_once_a_step_at_its_last_bucket():
    for out in run_on_ranks(_reads_in_a_step, 2, REPAIRABLE, "repair", timeout=140):
        for name, ((finite_reads, finite), (bad_reads, _)) in out.items():
            assert finite, name
            assert (finite_reads, bad_reads) == (1, 1), name


def _two_hops_both_ways(rank: int, world_size: int) -> dict[Any, Any]:
    """int8 and packed int4 on 2 machines of 2 ranks, their collectives completing as gloo's
    and as NCCL's do, in a scaler's loop (rank 0's gradient poisoned at the fifth step): each
    step's host reads and finiteness, whether a reduce-scatter ran, and the parameters after."""
    os.environ[comm.topology.MACHINE_ID_VAR] = f"machine{rank // 2}"
    out = {}
    for name in ("int8", "packed_int4"):
        for inline in (False, True):
            ddp, poison = _model(name, None)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            steps = []
            with comm.completing_inline() if inline else contextlib.nullcontext():
                for step, batch in enumerate(batches(rank, 6)):
                    poison["now"] = step == 4
                    opt.zero_grad(set_to_none=True)
                    reads = _Reads()
                    with comm.observe_collectives() as seen:
                        _step(ddp, batch, reads)
                    finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
                    steps.append((reads.count, finite, "reduce_scatter_tensor" in seen.bytes))
                    if finite:
                        opt.step()
            out[name, inline] = (steps, flat_params(ddp.module))
    return out


@pytest.mark.timeout(150)
def test_two_hops_read_nothing_back_and_complete_inline_with_gloos_bits():
    ranks = run_on_ranks(_two_hops_both_ways, 4, timeout=140)
    for out in ranks:
        for name in ("int8", "packed_int4"):
            (gloo, gloo_params), (inline, params) = out[name, False], out[name, True]
            for steps in (gloo, inline):
                assert [reads for reads, _, _ in steps[1:]] == [0] * 5, name
                assert [finite for _, finite, _ in steps] == [True] * 4 + [False, True], name
                assert all(two_hops for _, _, two_hops in steps), name
            assert torch.isfinite(params).all() and torch.equal(params, gloo_params), name
            assert torch.equal(params, ranks[0][name, True][1]), name


def _scaler_loop(rank: int, world_size: int, names: list[str]) -> dict[str, list[bool]]:
    """Train each hook, skipping the steps whose gradients are not finite as a loss scaler
    does; rank 0's gradient is poisoned at the fourth step. Whether each step was finite."""
    out = {}
    for name in names:
        ddp, poison = _model(name, None)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        finite = []
        for step, batch in enumerate(batches(rank, 8)):
            poison["now"] = step == 3
            opt.zero_grad(set_to_none=True)
            _step(ddp, batch, None)
            finite.append(all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters()))
            if finite[-1]:
                opt.step()
        out[name] = finite
    return out


@pytest.mark.timeout(150)
def test_after_one_injected_inf_every_later_step_is_finite_for_every_hook():
    for out in run_on_ranks(_scaler_loop, 2, list(HOOKS), timeout=140):
        for name, finite in out.items():
            assert finite == [True] * 3 + [False] + [True] * 4, (name, finite)


def _threads_after_training(rank: int, world_size: int, names: list[str]) -> dict[str, list[str]]:
    """The Python threads alive after a few steps of each hook, and of PyTorch's fp16 hook."""
    import threading

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default

    def alive() -> list[str]:
        return sorted(t.name for t in threading.enumerate())

    out = {}
    ddp = make_ddp(make_mlp(widths=_MANY_BUCKETS), bucket_cap_mb=0.00001)
    ddp.register_comm_hook(None, torch_default.fp16_compress_hook)
    for batch in batches(rank, 4):
        _step(ddp, batch, None)
    out["pytorch_fp16"] = alive()
    for name in names:
        ddp, _ = _model(name, None)
        for batch in batches(rank, 4):
            _step(ddp, batch, None)
        out[name] = alive()
    return out


@pytest.mark.timeout(150)
def test_no_hook_starts_a_python_thread_of_its_own():
    for out in run_on_ranks(_threads_after_training, 2, list(HOOKS), timeout=140):
        for name, threads in out.items():
            assert threads == out["pytorch_fp16"], (name, threads)
