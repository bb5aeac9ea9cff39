"""Where a hook reads a value back to the host, counted on the CPU as on a GPU.

On a GPU a read (``.item()``, ``bool(tensor)``, ``float(tensor)``) makes the host wait until
the device has caught up. Within the backward pass that wait stops the rest of the pass from
being queued, and with it the overlap of communication and computation. Every such read goes
through one operator, ``aten._local_scalar_dense``, which a dispatch mode sees on any device.
Under :func:`commhooks.comm.completing_inline` the hooks take the GPU's control flow on the CPU
(futures complete as they are issued, follow-ups held until the last bucket), so counting that
operator per hook call shows where a GPU's host would wait:

* ``allreduce_hook`` reads nothing in a whole step;
* the hooks whose finite/non-finite decisions need a read (fp16, bf16, PowerSGD, int8, int4)
  read nothing while any bucket but the last is handed to them: the decisions wait for the
  last bucket, when the backward pass is queued whole, and read once a bucket there (on a GPU
  the first read waits for the device, the others find their values copied already).
"""

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import commhooks
from commhooks import _reads, comm
from commhooks.compress import lowrank
from commhooks.testing import run_on_ranks

_READ = torch.ops.aten._local_scalar_dense.default
_MANY_BUCKETS = (32,) + (8,) * 20  # 20 layers: 40 buckets, one a parameter


class _Reads(TorchDispatchMode):
    """Counts the reads to the host of tensor values, in the thread it is entered in."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _READ:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return self.count


def _counting(hook: Callable[..., Any], count: Callable[[], int], per_call: list[int]) -> Any:
    """``hook``, recording by how much each of its calls raised ``count()`` before returning."""

    def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        before = count()
        fut = hook(state, bucket)
        per_call.append(count() - before)
        return fut

    return counted


def _hooks() -> dict[str, tuple[Callable[[], Any], Callable[..., Any]]]:
    power = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    return {
        "allreduce": (lambda: None, commhooks.allreduce_hook),
        "fp16": (lambda: None, commhooks.fp16_compress_hook),
        "bf16": (lambda: None, commhooks.bf16_compress_hook),
        "power_sgd": (lambda: commhooks.PowerSGDState(None, **power), commhooks.powerSGD_hook),
        "single_round": (
            lambda: commhooks.PowerSGDState(None, single_round=True, **power),
            commhooks.powerSGD_hook,
        ),
        "int8": (lambda: commhooks.QuantizationState(bits=8), commhooks.quantized_hook),
        "int4": (lambda: commhooks.QuantizationState(bits=4), commhooks.quantized_hook),
    }


def _reads_per_call(
    rank: int, names: list[str], widths: tuple[int, ...], warm_up: int
) -> dict[str, list[int]]:
    """The reads of each hook call in one step, with GPU's control flow, one bucket a
    parameter; ``warm_up`` steps first (past the handshake, DDP's rebuild, PowerSGD's start)."""
    from ddp_utils import batches, make_ddp, make_mlp, train

    out = {}
    for name in names:
        make_state, hook = _hooks()[name]
        ddp = make_ddp(make_mlp(widths=widths), bucket_cap_mb=0.00001)
        reads, per_call = _Reads(), []
        ddp.register_comm_hook(make_state(), _counting(hook, reads.total, per_call))
        with comm.completing_inline():
            train(ddp, batches(rank, warm_up))
            per_call.clear()
            with reads:
                train(ddp, batches(rank, 1))
        out[name] = list(per_call)
    return out


def _reads_in_a_step(rank: int, world_size: int) -> dict[str, list[int]]:
    return _reads_per_call(rank, list(_hooks()), _MANY_BUCKETS, 4)


@pytest.mark.timeout(120)
def test_no_hook_reads_a_value_back_before_the_last_bucket_of_a_step():
    for out in run_on_ranks(_reads_in_a_step, 2, timeout=110):
        for name, per_call in out.items():
            assert len(per_call) > 10, name  # many buckets, every one counted
            assert per_call[:-1] == [0] * (len(per_call) - 1), (name, per_call)
            assert per_call[-1] <= len(per_call), (name, per_call[-1])  # one a bucket at most
        assert sum(out["allreduce"]) == 0  # its callbacks ran inside the calls, as with NCCL


def _large_bucket_reads(rank: int, world_size: int) -> dict[str, list[int]]:
    from ddp_utils import IN, OUT

    # 200 x 200 weights: buckets past the size from which a CPU bucket carries a flag element
    # read back (hooks/_half.py); as on a GPU, none may be read here.
    return _reads_per_call(rank, ["fp16", "bf16"], (IN, *(200,) * 5, OUT), 2)


@pytest.mark.timeout(120)
def test_large_half_precision_buckets_read_nothing_before_the_last_as_on_a_gpu():
    for out in run_on_ranks(_large_bucket_reads, 2, timeout=110):
        for name, per_call in out.items():
            assert len(per_call) >= 6, (name, per_call)
            assert per_call[:-1] == [0] * (len(per_call) - 1), (name, per_call)


def _collectives_per_call(rank: int, world_size: int) -> dict[str, list[int]]:
    from ddp_utils import batches, make_ddp, make_mlp, train

    out = {}
    for name in ("power_sgd", "int8"):
        make_state, hook = _hooks()[name]
        ddp = make_ddp(make_mlp(widths=_MANY_BUCKETS), bucket_cap_mb=0.00001)
        per_call: list[int] = []
        with comm.completing_inline(), comm.observe_collectives() as counter:
            issued = _counting(hook, lambda c=counter: sum(c.calls.values()), per_call)
            ddp.register_comm_hook(make_state(), issued)
            train(ddp, batches(rank, 4))
            per_call.clear()
            train(ddp, batches(rank, 1))
        out[name] = per_call
    return out


@pytest.mark.timeout(120)
def test_second_collectives_are_issued_within_the_hook_call_where_collectives_complete_at_once():
    # As on NCCL: PowerSGD's Q round and the quantized gather overlap the backward pass as the
    # first collective does; only the decisions that read wait for the last bucket.
    for out in run_on_ranks(_collectives_per_call, 2, timeout=110):
        firsts = {"power_sgd": 1, "int8": 1}  # P (vectors ride with it or alone), all-to-all
        for name, per_call in out.items():
            assert len(per_call) > 10, name
            assert all(n > firsts[name] for n in per_call[:-1]), (name, per_call)


def test_finite_each_reads_every_tensors_finiteness_at_once():
    from commhooks import finiteness

    half = torch.float16
    tensors = [
        torch.full((1000,), 65504.0, dtype=half),  # finite: its float32 norm does not overflow
        torch.tensor([1.0, float("inf")], dtype=half),
        torch.tensor([float("nan"), 0.0]),
        torch.zeros(0),
        torch.tensor([-2.0, 3.0], dtype=torch.bfloat16),
    ]
    assert finiteness.finite_each(tensors) == [True, False, False, True, True]
    assert finiteness.finite_each([]) == []


def test_finite_each_answers_a_finite_step_from_one_flag_and_changes_no_bit():
    from commhooks import finiteness

    tiny = torch.finfo(torch.float32).tiny
    tensors = [
        torch.tensor([1e30, -1e30, 3e38]),  # finite, though a float32 norm of them overflows
        torch.tensor([-0.0, tiny / 8, -tiny / 2]),  # negative zero and subnormals
        torch.tensor([65504.0, -6e-8], dtype=torch.float16),
        torch.tensor([3e38, -1e-40], dtype=torch.bfloat16),
    ]
    before = [t.clone() for t in tensors]
    norms = []
    real_norm = torch._foreach_norm
    with mock.patch.object(
        torch, "_foreach_norm", lambda *a, **k: norms.append(1) or real_norm(*a, **k)
    ):
        assert finiteness.finite_each(tensors) == [True] * 4
        assert norms == []  # the flag alone answered
        tensors[2][1] = float("nan")
        assert finiteness.finite_each(tensors) == [True, True, False, True]
        assert norms == [1]  # the flag was set: each tensor's norm says which
    tensors[2][1] = before[2][1]
    for got, was in zip(tensors, before):  # multiplied by one in place: the same bits
        assert torch.equal(
            got.view(torch.int16 if got.element_size() == 2 else torch.int32),
            was.view(torch.int16 if was.element_size() == 2 else torch.int32),
        )


def test_finite_each_falls_back_to_norms_where_the_flag_kernel_refuses():
    from commhooks import finiteness

    def refuse(*args: object) -> None:
        raise NotImplementedError("not implemented for 'BFloat16'")

    tensors = [torch.ones(3), torch.tensor([1.0, float("inf")])]
    with mock.patch.object(torch, "_amp_foreach_non_finite_check_and_unscale_", refuse):
        assert finiteness.finite_each(tensors) == [True, False]
        assert finiteness.finite_each(tensors[:1]) == [True]


def test_held_checks_answer_every_bucket_with_one_read_at_the_first_question():
    from commhooks import finiteness

    held = finiteness.HeldChecks()
    owners = [object() for _ in range(4)]
    inf = float("inf")
    held.hold(owners[0], torch.ones(3), torch.ones(2))
    held.hold(owners[1], torch.ones(3), torch.tensor([1.0, inf]))  # its second tensor
    held.hold(owners[2], torch.tensor([float("nan")]))
    held.hold(owners[3], torch.full((8,), 2.0, dtype=torch.float16))
    answers, batched = [], []
    real = finiteness.finite_each
    with mock.patch.object(
        finiteness, "finite_each", lambda ts: batched.append(len(ts)) or real(ts)
    ):
        for owner in owners:
            answers.append(held.finite(owner))
            assert batched == [6], batched  # one batched check of all 6 tensors, at the first
    assert answers == [True, False, False, True]
    with pytest.raises(RuntimeError, match="never held"):
        held.finite(owners[0])  # answered once: its step has moved on
    # A step abandoned before its questions: its answers go with the next settling.
    held.hold(owners[0], torch.ones(1))
    held.hold(owners[1], torch.ones(1))
    assert held.finite(owners[0])
    held.hold(owners[2], torch.tensor([inf]))
    assert not held.finite(owners[2])
    with pytest.raises(RuntimeError, match="never held"):
        held.finite(owners[1])


def test_powersgds_passes_over_a_cpu_matrix_go_whole_as_on_a_gpu():
    # Blocks of rows are a CPU's way (cache); the GPU's branch takes each matrix whole, and so
    # must a CPU matrix that stands for a GPU's, or the host cost measured would not be a GPU's.
    matrix = torch.zeros(8, 4)
    assert lowrank._blocked(matrix)
    with _reads.as_on_a_gpu():
        assert not lowrank._blocked(matrix)
    assert lowrank._blocked(matrix)
