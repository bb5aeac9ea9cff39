"""The quantized hook's shortcuts keep the two phases' bits: a group of one rank sends nothing,
and where collectives complete as they are queued (NCCL's way, here through
``comm.completing_inline``) the checks of the gathered scales are held with the step's others
and answered together by the first decision, held until the step's last bucket."""

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
        # Nothing travels, but the plain average of the step with inf and NaN.
        assert calls == {"all_reduce": 1}, (inline, bits)
        for step, (grad, applied, before, before_owner, after) in enumerate(steps):
            first = before.get(0, torch.zeros(300))
            second = before_owner.get("0:0-300", torch.zeros(300))
            if step == 2:  # inf and NaN: the plain average of one rank, memories spared
                assert torch.equal(applied.isnan(), grad.isnan())
                assert torch.equal(applied.nan_to_num(), grad.nan_to_num())
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


def _held(rank: int, world_size: int) -> dict:
    from commhooks import finiteness
    from commhooks.hooks._held_sums import held_sums

    checks: list[int] = []  # the tensors of each batched check, as it is made
    real = finiteness.finite_each

    def spy(tensors: list[torch.Tensor]) -> list[bool]:
        checks.append(len(tensors))
        return real(tensors)

    finiteness.finite_each = spy
    out: dict = {}
    for inline in (False, True):
        state = QuantizationState(None, bits=8, block_size=BLOCK)
        buckets = [FakeBucket([torch.zeros(100 + 50 * i)], index=i, last=i == 3) for i in range(4)]
        for step in range(2):
            grads = [_grad(rank, b.buffer().numel(), step) for b in buckets]
            if step == 1:
                grads[1][5 + rank] = float("nan")
            before = state.state_dict()
            futures, seen = [], []
            checks.clear()
            with comm.completing_inline() if inline else _nothing():
                for bucket, grad in zip(buckets, grads):
                    bucket.set_buffer(grad.clone())
                    futures.append(quantized_hook(state, bucket))
                    pending = held_sums(state.issuer).pending if state.issuer else 0
                    seen.append((pending, list(checks), [f.done() for f in futures]))
            applied = [f.wait().clone() for f in futures]
            out[inline, step] = (grads, applied, seen, before, state.state_dict())
    return out


@pytest.mark.timeout(120)
def test_held_checks_are_answered_together_at_the_last_bucket():
    ranks = run_on_ranks(_held, 2, env=ENV, timeout=100)
    for out in ranks:
        for step in range(2):
            grads, applied, seen, before, after = out[True, step]
            # Each bucket is held as its hook returns, its future not done; nothing is read
            # before the last, and then all four are answered by one batched check.
            for i in range(3):
                assert seen[i] == (i + 1, [], [False] * (i + 1)), seen
            assert seen[3] == (0, [4], [True] * 4), seen
            assert all(s[0] == 0 and s[1] == [] for s in out[False, step][2])  # read as it goes
            _, applied_gloo, _, _, after_gloo = out[False, step]
            for ours, gloo in zip(applied, applied_gloo):
                assert torch.equal(ours.nan_to_num(), gloo.nan_to_num())
            if step == 1:  # the NaN bucket comes back as plain allreduce puts it
                assert applied[1].isnan().sum() == 2
                assert all(torch.isfinite(a).all() for i, a in enumerate(applied) if i != 1)
                number = 1  # bucket 1's parameter: numbered as the buckets came
                assert torch.equal(after["error"][str(number)], before["error"][str(number)])
    plain = ranks[0][True, 1][0][1] * 0.5 + ranks[1][True, 1][0][1] * 0.5
    assert torch.equal(ranks[0][True, 1][1][1].nan_to_num(), plain.nan_to_num())


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
    # collective's can be): that bucket fails, and the others are decided as usual.
    from commhooks.hooks.quantized import hook

    issue = comm.issue_all_gather  # the held path's: issued straight on the group
    calls = []

    def failing(out: torch.Tensor, tensor: torch.Tensor, group: object) -> object:
        calls.append(len(calls))
        if len(calls) == 2:
            failed: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            failed.set_exception(RuntimeError("the all-gather of bucket 1 failed"))
            return failed
        return issue(out, tensor, group)

    hook.comm.issue_all_gather = failing  # type: ignore[assignment]
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


def _abandoned(rank: int, world_size: int, eager: bool) -> tuple:
    """A held step whose last bucket never comes, its one bucket holding NaN (whose block's
    padding the quantizing pass then fills with NaN), then a whole step on the same buffer.
    ``eager``: PyTorch's operations, whose block maximum NaN makes NaN, as a GPU's does (the
    CPU kernels' maximum passes over NaN)."""
    from commhooks.compress import cpu_kernels

    with cpu_kernels.disabled() if eager else _nothing():
        return _abandoned_step(rank)


def _abandoned_step(rank: int) -> tuple:
    state = QuantizationState(None, bits=8, block_size=BLOCK)
    fresh = QuantizationState(None, bits=8, block_size=BLOCK)
    bucket = FakeBucket([torch.zeros(100)], index=0, last=False)  # 100 of 128: padded
    grad = _grad(rank, 100, 0)
    broken = grad.clone()
    broken[99] = float("nan")  # in the last block, with the padding
    with comm.completing_inline():
        bucket.set_buffer(broken)
        stale = quantized_hook(state, bucket)
        memories = state.state_dict()
        done_before = stale.done()
        bucket.set_last(True)
        results = []
        for hooked, buffer in ((state, bucket.buffer()), (fresh, torch.zeros(100))):
            bucket.set_buffer(buffer.copy_(grad))  # DDP's next step: the same bucket buffer
            results.append(quantized_hook(hooked, bucket).wait().clone())
    try:
        stale.wait()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    return done_before, error, memories, results


@pytest.mark.parametrize("eager", [False, True])
def test_an_abandoned_held_step_fails_its_buckets_and_leaves_no_nan_behind(eager):
    ranks = run_on_ranks(_abandoned, 2, eager, env=ENV)
    for done_before, error, memories, (ours, fresh) in ranks:
        assert not done_before and "abandoned with its step" in error
        assert memories["error"] == {} and memories["owner_error"] == {}  # nothing committed
        # The next step on the same buffer starts from zeroed padding: a fresh state's bits.
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
