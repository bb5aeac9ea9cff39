"""The quantization math of ``commhooks.quantize``, in one process: bounds, packing, formats."""

from typing import Any

import pytest
import torch

from commhooks.compress import blocks as quantize
from commhooks.compress.blocks import BlockFormat


def _encode(x: torch.Tensor, fmt: BlockFormat, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a copy of ``x``; return the packets and what was left in the copy."""
    left = x.clone()
    packets = torch.empty(x.shape[0], fmt.packet_bytes(x.shape[1]), dtype=torch.uint8)
    quantize.quantize_(left, packets, fmt, torch.empty_like(x), **kwargs)
    return packets, left


def _decode(packets: torch.Tensor, fmt: BlockFormat, shape, dtype=torch.float32) -> torch.Tensor:
    return quantize.dequantize_(packets, fmt, torch.empty(shape, dtype=dtype))


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax, broadcast back to ``x``'s shape."""
    rows, length = x.shape
    amax = x.view(rows, -1, block).abs().amax(2, keepdim=True)
    return amax.expand(rows, length // block, block).reshape(rows, length)


@pytest.mark.parametrize("bits", [8, 4])
def test_nearest_rounding_stays_within_half_a_step_and_leaves_the_error(bits):
    fmt = BlockFormat(bits, 16)
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 64, generator=gen) * torch.logspace(-3, 3, 64)  # blocks of many scales
    x[1, :16] = 0  # a block of zeros
    packets, left = _encode(x, fmt)
    decoded = _decode(packets, fmt, x.shape)
    error = x - decoded
    half_step = _block_absmax(x, 16) / (2 * fmt.qmax)
    assert bool((error.abs() <= half_step * (1 + 1e-6)).all())
    assert error.abs().max() > 0  # it did quantize
    assert torch.equal(decoded[1, :16], torch.zeros(16))  # zeros are exact
    torch.testing.assert_close(left, error, rtol=0, atol=1e-6 * x.abs().max().item())
    assert bool((decoded.abs() <= _block_absmax(x, 16) * (1 + 1e-6)).all())


def test_without_keep_error_the_input_is_left_as_it_was():
    fmt, x = BlockFormat(8, 8), torch.randn(2, 32)
    packets, left = _encode(x, fmt, keep_error=False)
    assert torch.equal(left, x)
    assert torch.equal(packets, _encode(x, fmt)[0])


def test_int4_packs_two_offset_nibbles_a_byte_low_first():
    fmt = BlockFormat(4, 8)
    x = torch.tensor([[-7.0, 7.0, 0.0, 1.0, -1.0, 3.0, 2.0, -3.0]])  # absmax 7: scale 1
    packets, _ = _encode(x, fmt)
    codes = [k + 8 for k in (-7, 7, 0, 1, -1, 3, 2, -3)]
    expected = [lo | hi << 4 for lo, hi in zip(codes[::2], codes[1::2])]
    assert packets[0, :4].tolist() == expected
    assert packets[0, 4:].view(torch.float32).item() == 1.0
    assert torch.equal(_decode(packets, fmt, x.shape), x)


def test_int8_codes_are_rounded_levels():
    fmt = BlockFormat(8, 8)
    x = torch.tensor([[127.0, -127.0, 0.4, 0.6, -0.6, 2.5, 3.5, 10.0]])
    packets, _ = _encode(x, fmt)
    assert packets[0, :8].view(torch.int8).tolist() == [127, -127, 0, 1, -1, 2, 4, 10]


def test_stochastic_rounding_is_unbiased_in_range_and_reproducible():
    fmt = BlockFormat(4, 8)
    x = torch.tensor([[7.0, -7.0, 0.25, 0.5, -2.75, 6.9, 0.0, 1.0]]).repeat(4000, 1)
    first = torch.Generator().manual_seed(5)
    packets, left = _encode(x, fmt, rounding=quantize.STOCHASTIC, generator=first)
    decoded = _decode(packets, fmt, x.shape)
    assert bool(((x - decoded).abs() < 1).all())  # one of the two nearest levels
    assert bool((decoded.abs() <= 7).all())
    torch.testing.assert_close(decoded.mean(0), x[0], rtol=0, atol=0.05)
    assert set(decoded[:, 2].unique().tolist()) == {0.0, 1.0}
    torch.testing.assert_close(left, x - decoded, rtol=0, atol=1e-6)
    again = _encode(
        x, fmt, rounding=quantize.STOCHASTIC, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(again[0], packets)


@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_blocks_show_in_their_scales(bits):
    fmt = BlockFormat(bits, 8)
    x = torch.randn(2, 32)
    assert _scales_finite(_encode(x, fmt)[0], fmt, 32)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[1, 9] = bad
        packets = _encode(y, fmt)[0]
        assert not _scales_finite(packets, fmt, 32)
        assert bool(torch.isfinite(_decode(packets, fmt, y.shape)[0]).all())  # other rows fine


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decoding_into_half_precision_rounds_the_float32_values(dtype):
    fmt = BlockFormat(8, 16)
    packets = _encode(torch.randn(2, 48), fmt)[0]
    exact = _decode(packets, fmt, (2, 48))
    torch.testing.assert_close(_decode(packets, fmt, (2, 48), dtype), exact.to(dtype))


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_sum_adds_the_rows(bits):
    fmt = BlockFormat(bits, 8)
    packets = _encode(torch.randn(3, 24), fmt)[0]
    total = quantize.dequantize_sum(packets, fmt, torch.empty(3, 24), torch.empty(24))
    torch.testing.assert_close(total, _decode(packets, fmt, (3, 24)).sum(0))


@pytest.mark.parametrize("bits", [8, 4])
def test_summed_rows_are_added_in_row_order_on_every_device(bits):
    # Eight rows, whose sum depends on the order of the additions: the kernels add row after
    # row, and so must PyTorch's form, or ranks with and without a kernel drift apart.
    fmt = BlockFormat(bits, 8)
    big, small = torch.full((1, 24), 2.0**24), torch.full((1, 24), 1.0)
    rows = torch.cat([big, small, -big, small, big, small, small, -big])
    packets = _encode(rows, fmt)[0]
    decoded = _decode(packets, fmt, (8, 24))
    in_order = decoded[0].clone()
    for row in decoded[1:]:
        in_order += row
    pairs = ((decoded[0] + decoded[4]) + (decoded[1] + decoded[5])) + (
        (decoded[2] + decoded[6]) + (decoded[3] + decoded[7])
    )
    assert not torch.equal(in_order, pairs)  # the order shows in the bits
    total = quantize.dequantize_sum(packets, fmt, torch.empty(8, 24), torch.empty(24))
    assert torch.equal(total, in_order)


def test_formats_size_rows_and_packets():
    fmt = BlockFormat(4, 256)
    assert (fmt.qmax, BlockFormat(8, 8).qmax) == (7, 127)
    assert fmt.row_length(1, 3) == 256 and fmt.row_length(1025, 2) == 768
    assert fmt.packet_bytes(512) == 256 + 8
    # On the wire, per element, against float32's 4 bytes (both sent 2 (p - 1) / p times).
    assert BlockFormat(8, 256).packet_bytes(256) / (4 * 256) <= 0.27
    assert fmt.packet_bytes(256) / (4 * 256) <= 0.15


def test_affine_qparams_are_pytorchs_observers():
    from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

    gen = torch.Generator().manual_seed(0)
    for x in (torch.randn(1, 100, generator=gen) + 3, torch.randn(5, 16, generator=gen) * 1e-3):
        observer = PerChannelMinMaxObserver() if x.shape[0] > 1 else MinMaxObserver()
        observer(x if x.shape[0] > 1 else x.view(-1))
        scale, zero_point = observer.calculate_qparams()
        qparams = quantize.affine_qparams(x)
        assert torch.equal(qparams[0], scale.to(torch.float32))
        assert torch.equal(qparams[1], zero_point.to(torch.float32))
    zeros = quantize.affine_qparams(torch.zeros(2, 4))
    assert zeros[0].tolist() == [torch.finfo(torch.float32).eps] * 2


def test_affine_qparams_make_no_tensor_of_a_host_number():
    # On a GPU a tensor made from a host number is a copy the host waits for, at every bucket
    # of PyTorch's quantization drop-ins: the floor of the scale is passed as a number.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Made(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    x[1] = 0.0
    x[2, 0] = float("nan")
    with Made() as made:
        qparams = quantize.affine_qparams(x)
    assert made.ops and "aten.lift_fresh.default" not in made.ops
    assert qparams[0, 1].item() == torch.finfo(torch.float32).eps
    assert torch.isnan(qparams[0, 2])  # a NaN channel's scale stays NaN, as torch.maximum's


def test_affine_round_trip_matches_pytorchs_backend_functions():
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as reference

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    qparams = quantize.affine_qparams(x)
    codes = torch.empty(4, 32, dtype=torch.uint8)
    quantize.quantize_affine(x, qparams, codes)
    expected = reference._quantize_per_channel_backend(x, qparams[0], qparams[1])
    assert torch.equal(codes, expected)
    decoded = reference._dequantize_per_channel_backend(expected, qparams[0], qparams[1])
    assert torch.equal(quantize.dequantize_affine(codes, qparams), decoded)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rounding", quantize.ROUNDINGS)
def test_what_quantization_drops_is_plausible_and_an_absurd_memory_is_not(bits, rounding):
    fmt = BlockFormat(bits, 64)
    gen = torch.Generator().manual_seed(bits)
    gradient = torch.randn(2, 256, generator=gen)
    memory = torch.zeros_like(gradient)
    packets = torch.empty(2, fmt.packet_bytes(256), dtype=torch.uint8)
    for _ in range(20):  # error feedback: the memory rides along step after step
        rows = gradient + memory
        quantize.quantize_(
            rows, packets, fmt, torch.empty_like(rows), rounding=rounding, generator=gen
        )
        memory = rows  # the error left in place
        assert fmt.plausible_residual(memory, gradient)
        assert fmt.plausible_residual(memory, gradient / 100)  # a gradient shrunk since
    assert not fmt.plausible_residual(torch.full_like(memory, 1e6), gradient)
    assert not fmt.plausible_residual(memory, torch.zeros_like(gradient))


def test_what_a_low_rank_approximation_drops_is_plausible_and_an_absurd_memory_is_not():
    from commhooks.compress import lowrank

    gen = torch.Generator().manual_seed(0)
    gradient = torch.randn(32, 16, generator=gen)
    memory = torch.zeros_like(gradient)
    for _ in range(20):  # rank-1 approximations with error feedback
        m = gradient + memory
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        memory = m - s[0] * torch.outer(u[:, 0], vh[0])
        assert lowrank.plausible_residual(memory, gradient)
    assert not lowrank.plausible_residual(torch.full_like(memory, 1e6), gradient)


def _scales_finite(packets, fmt, length):
    """Whether every scale in ``packets`` is finite (no block held inf or NaN)."""
    return bool(torch.isfinite(fmt.split(packets, length)[1]).all())
