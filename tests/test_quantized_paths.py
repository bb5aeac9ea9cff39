"""The quantized hook's paths keep the two phases' bits: a group of one rank sends nothing,
collectives that complete as they are queued (NCCL's way, here through
``comm.completing_inline``) give gloo's bits, a failed all-gather fails its bucket alone, a
non-finite step leaves nothing behind, and the CPU kernels' bound calls give the eager bits."""

import pytest
import torch
from ddp_utils import FakeBucket

from commhooks import QuantizationState, comm, quantized_hook
from commhooks.testing import run_on_ranks

BLOCK = 64
ENV = {"OMP_NUM_THREADS": "1"}


def _grad(rank: int, n: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + 10 * rank + n)
    return torch.randn(n, generator=gen) * torch.linspace(0.01, 3, n)


def _two_phases_alone(grad, first, second, bits):
    """The two phases on one rank, written out with the math's functions: the applied result,
    and the two errors left."""
    from commhooks.compress import blocks

    fmt, n = blocks.BlockFormat(bits, BLOCK), grad.numel()
    length = fmt.row_length(n, 1)
    rows, scratch = torch.zeros(1, length), torch.zeros(1, length)
    sent = torch.empty(1, fmt.packet_bytes(length), dtype=torch.uint8)
    rows[0, :n] = grad + first
    blocks.quantize_(rows, sent, fmt, scratch)
    mine = blocks.dequantize_sum(sent, fmt, scratch, torch.zeros(length)).view(1, length)
    mine[0, :n] += second
    gathered = torch.empty_like(sent)
    blocks.quantize_(mine, gathered, fmt, scratch)
    applied = blocks.dequantize_(gathered, fmt, torch.zeros(1, length))[0, :n]
    return applied, rows[0, :n].clone(), mine[0, :n].clone()


def _alone(rank: int, world_size: int) -> dict:
    out: dict = {}
    for inline in (False, True):
        for bits in (8, 4):
            state = QuantizationState(None, bits=bits, block_size=BLOCK)
            bucket = FakeBucket([torch.zeros(300)])
            steps = []
            with comm.observe_collectives() as counter:
                for step in range(4):
                    grad = _grad(rank, 300, step)
                    if step == 2:
                        grad[7], grad[100] = float("nan"), float("inf")
                    before = {k: t.clone() for k, t in state.error.items()}
                    before_owner = {k: t.clone() for k, t in state.owner_error.items()}
                    bucket.set_buffer(grad.clone())
                    with comm.completing_inline() if inline else _nothing():
                        applied = quantized_hook(state, bucket).wait().clone()
                    steps.append((grad, applied, before, before_owner, state.state_dict()))
            out[inline, bits] = (steps, counter.calls)
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.timeout(120)
def test_one_rank_sends_nothing_and_applies_the_two_phases_bits():
    [out] = run_on_ranks(_alone, 1, env=ENV, timeout=100)
    for (inline, bits), (steps, calls) in out.items():
        assert calls == {}, (inline, bits)  # nothing travels
        for step, (grad, applied, before, before_owner, after) in enumerate(steps):
            first = before.get(0, torch.zeros(300))
            second = before_owner.get("0:0-300", torch.zeros(300))
            if step == 2:  # inf and NaN: non-finite where they were, memories spared
                assert not applied[~grad.isfinite()].isfinite().any()
                assert torch.equal(after["error"]["0"], first)
                assert torch.equal(after["owner_error"]["0:0-300"], second)
                continue
            expected, error, owner_error = _two_phases_alone(grad, first, second, bits)
            assert torch.equal(applied, expected), (inline, bits, step)
            assert torch.equal(after["error"]["0"], error)
            assert torch.equal(after["owner_error"]["0:0-300"], owner_error)
    for bits in (8, 4):  # held or not, the same bits
        for ours, theirs in zip(out[False, bits][0], out[True, bits][0]):
            assert torch.equal(ours[1].nan_to_num(), theirs[1].nan_to_num())


def _huge(rank: int, world_size: int) -> tuple:
    # Finite gradients near float32's limit: the scales are finite, their norm is not.
    import warnings

    state = QuantizationState(None, bits=8, block_size=BLOCK)
    grad = _grad(rank, 300, 0) * 1e37
    with warnings.catch_warnings(record=True) as caught, comm.completing_inline():
        warnings.simplefilter("always")
        applied = quantized_hook(state, FakeBucket([grad.clone()])).wait()
    return grad, applied, [str(w.message) for w in caught]


def test_finite_scales_whose_held_norm_overflows_are_not_sent_again():
    (g0, applied, caught), (g1, applied1, _) = run_on_ranks(_huge, 2, env=ENV)
    assert not any("sent again" in m for m in caught), caught
    assert torch.isfinite(applied).all() and torch.equal(applied, applied1)
    exact = (g0 + g1) / 2  # within the int8 bound: two rounding steps of max|g| / 127 each
    assert ((applied - exact).abs() <= 2 * exact.abs().max() / 127).all()


def _failed_gather(rank: int, world_size: int) -> tuple:
    # The all-gather of bucket 1 fails as it is issued (a future already failed, as an NCCL
    # collective's can be): that bucket fails, and the others finish as usual.
    from commhooks.hooks.quantized import hook

    gather = comm.all_gather_into
    calls = []

    def failing(out: torch.Tensor, tensor: torch.Tensor, group: object) -> object:
        calls.append(len(calls))
        if len(calls) == 2:
            failed: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            failed.set_exception(RuntimeError("the all-gather of bucket 1 failed"))
            return failed
        return gather(out, tensor, group)

    hook.comm.all_gather_into = failing  # type: ignore[assignment]
    state = QuantizationState(None, bits=8, block_size=BLOCK)
    buckets = [FakeBucket([_grad(rank, 200, i)], index=i, last=i == 2) for i in range(3)]
    with comm.completing_inline():
        futures = [quantized_hook(state, bucket) for bucket in buckets]
    outcomes = []
    for future in futures:
        try:
            outcomes.append(bool(torch.isfinite(future.wait()).all()))
        except RuntimeError as error:
            outcomes.append(str(error))
    assert state.issuer is not None
    return outcomes, state.issuer.pending


def test_an_all_gather_failed_as_issued_fails_its_bucket_alone():
    for outcomes, pending in run_on_ranks(_failed_gather, 2, env=ENV):
        assert outcomes[0] is True and outcomes[2] is True, outcomes
        assert "the all-gather of bucket 1 failed" in outcomes[1], outcomes
        assert pending == 0  # no slot left waiting: the next step is not held back


def _after_a_bad_step(rank: int, world_size: int, eager: bool) -> tuple:
    """A step whose one bucket holds NaN in its last block (whose padding the quantizing pass
    then fills with NaN), then a finite step on the same buffer, and the same finite step on a
    fresh state. ``eager``: PyTorch's operations, whose block maximum NaN makes NaN, as a
    GPU's does (the CPU kernels' maximum passes over NaN)."""
    from commhooks.compress import cpu_kernels

    with cpu_kernels.disabled() if eager else _nothing():
        state = QuantizationState(None, bits=8, block_size=BLOCK)
        fresh = QuantizationState(None, bits=8, block_size=BLOCK)
        bucket = FakeBucket([torch.zeros(100)])  # 100 of 128: padded
        grad = _grad(rank, 100, 0)
        broken = grad.clone()
        broken[99] = float("nan")  # in the last block, with the padding
        with comm.completing_inline():
            bucket.set_buffer(broken)
            bad = quantized_hook(state, bucket).wait().clone()
            memories = state.state_dict()
            results = []
            for hooked in (state, fresh):
                bucket.set_buffer(grad.clone())
                results.append(quantized_hook(hooked, bucket).wait().clone())
    return bad, memories, results


@pytest.mark.parametrize("eager", [False, True])
def test_a_non_finite_step_leaves_no_nan_behind(eager):
    for bad, memories, (ours, fresh) in run_on_ranks(_after_a_bad_step, 2, eager, env=ENV):
        assert not bad[99].isfinite()
        # Nothing kept but zeros (the memories of a first step that was not finite).
        assert all(not t.any() for t in memories["error"].values())
        assert all(not t.any() for t in memories["owner_error"].values())
        # The next step on the same buffers: a fresh state's bits, no NaN left in the padding.
        assert torch.isfinite(ours).all() and torch.equal(ours, fresh)


def _steps_both_ways(rank: int, world_size: int) -> dict:
    """Three steps of three buckets (whole rows and a ragged end), with the CPU kernels'
    calls bound to each workspace's buffers, then with PyTorch's eager operations."""
    from commhooks.compress import cpu_kernels

    out = {}
    for eager in (False, True):
        state = QuantizationState(None, bits=4, block_size=BLOCK)
        buckets = [
            FakeBucket([torch.zeros(n)], index=i, last=i == 2) for i, n in enumerate((256, 300, 70))
        ]
        applied = []
        with cpu_kernels.disabled() if eager else _nothing():
            for step in range(3):
                futures = []
                for bucket in buckets:
                    bucket.set_buffer(_grad(rank, bucket.buffer().numel(), step))
                    futures.append(quantized_hook(state, bucket))
                applied.append([f.wait().clone() for f in futures])
        out[eager] = (applied, state.state_dict())
    return out


def test_bound_kernel_calls_give_the_eager_forms_bits_over_steps():
    for out in run_on_ranks(_steps_both_ways, 2, env=ENV):
        (fused, fused_state), (eager, eager_state) = out[False], out[True]
        for fused_step, eager_step in zip(fused, eager):
            assert all(torch.equal(a, b) for a, b in zip(fused_step, eager_step))
        for memory in ("error", "owner_error"):
            assert fused_state[memory].keys() == eager_state[memory].keys()
            for key, value in fused_state[memory].items():
                assert torch.equal(value, eager_state[memory][key]), (memory, key)


def _other_parameters(rank: int, world_size: int, inline: bool) -> tuple:
    """A bucket index that holds other parameters of the same sizes at the next step (a new
    model, DDP's rebuilt buckets) must not take the memories of the ones it held: the result
    is a fresh state's. The same parameters again take theirs: unlike a fresh state's."""
    state = QuantizationState(None, bits=4, block_size=BLOCK)
    held = FakeBucket([_grad(rank, 100, 0)], index=0)

    def step(hooked: QuantizationState, bucket: FakeBucket, grad: torch.Tensor) -> torch.Tensor:
        bucket.set_buffer(grad.clone())
        with comm.completing_inline() if inline else _nothing():
            return quantized_hook(hooked, bucket).wait().clone()

    step(state, held, _grad(rank, 100, 0))
    grad = _grad(rank, 100, 1)
    others = step(state, FakeBucket([grad]), grad)
    fresh = step(QuantizationState(None, bits=4, block_size=BLOCK), FakeBucket([grad]), grad)
    again = step(state, held, grad)  # the first parameters: their memory is still kept
    return torch.equal(others, fresh), torch.equal(again, fresh)


@pytest.mark.parametrize("inline", [False, True])
def test_a_bucket_of_other_parameters_does_not_take_the_last_ones_memories(inline):
    for same_as_fresh, again_as_fresh in run_on_ranks(_other_parameters, 2, inline, env=ENV):
        assert same_as_fresh and not again_as_fresh
