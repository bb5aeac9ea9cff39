"""Packed 4-bit codes: 13 levels, eight to 30 bits, so that codes and scales fit in 4 bits.

The packing is checked on its own (both forms give the same bytes, and unpacking undoes it),
and through the quantized hook on real gloo ranks against the two phases computed here with
the quantization math alone: a packed hook must give the bits of the unpacked exchange at 13
levels, and send the packed bytes.
"""

import contextlib

import pytest
import torch
from ddp_utils import FakeBucket

from commhooks import QuantizationState, comm, quantized_hook
from commhooks.compress import blocks, cpu_kernels, packing
from commhooks.compress.blocks import BlockFormat
from commhooks.testing import run_on_ranks

pytestmark = pytest.mark.timeout(120)

SIZES = (1077,)  # one bucket of one parameter
STEPS = 3
BLOCK = 256


def _nibbles(rows: int, groups: int, seed: int) -> torch.Tensor:
    """Bytes of two codes in [-6, 6] each, offset by 8: what a packed format's quantizer writes."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(2, 15, (rows, groups * 32), generator=gen, dtype=torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _both(run):
    """``run()`` with the C kernels, then with PyTorch's operations."""
    fused = run()
    with cpu_kernels.disabled():
        eager = run()
    return fused, eager


@pytest.mark.parametrize(("rows", "groups"), [(1, 1), (2, 7), (3, 1856)])
def test_packing_takes_fifteen_bytes_for_thirty_two_codes_and_unpacking_undoes_it(rows, groups):
    nibbles = _nibbles(rows, groups, seed=rows + groups)

    def pack():
        out = torch.full((rows, 15 * groups), 7, dtype=torch.uint8)
        packing.pack13_(nibbles, out)
        back = torch.zeros_like(nibbles)
        packing.unpack13_(out, back)
        return out, back

    (fused, fused_back), (eager, eager_back) = _both(pack)
    assert torch.equal(fused, eager)  # both forms, the same bytes
    assert torch.equal(fused_back, nibbles) and torch.equal(eager_back, nibbles)
    assert packing.packed_bytes(32 * groups) == 15 * groups


def test_any_bytes_unpack_to_codes_in_range_alike_in_both_forms():
    hostile = torch.randint(0, 256, (2, 15 * 64), generator=torch.Generator().manual_seed(5))
    hostile = hostile.to(torch.uint8)
    hostile[0, :15] = 255  # the largest 30-bit numbers, past 13 ** 8

    def unpack():
        out = torch.zeros(2, 16 * 64, dtype=torch.uint8)
        packing.unpack13_(hostile, out)
        return out

    fused, eager = _both(unpack)
    assert torch.equal(fused, eager)
    for half in (fused & 15, fused >> 4):
        assert int(half.min()) >= 2 and int(half.max()) <= 14


def test_rows_with_a_stride_pack_through_either_form():
    nibbles = _nibbles(2, 3, seed=1)
    wide = torch.zeros(2, 60, dtype=torch.uint8)
    target = wide[:, 5:50]  # rows of 45 bytes inside rows of 60, not 4-byte aligned
    packing.pack13_(nibbles, target)
    alone = torch.empty(2, 45, dtype=torch.uint8)
    with cpu_kernels.disabled():
        packing.pack13_(nibbles, alone)
    assert torch.equal(target, alone)
    assert int(wide[:, :5].abs().sum()) == 0 and int(wide[:, 50:].sum()) == 0  # nothing beside


def test_a_packed_format_takes_under_four_bits_a_value_with_its_scales():
    fmt = BlockFormat(4, BLOCK, packed=True)
    assert fmt.qmax == 6 and BlockFormat(4, BLOCK).qmax == 7
    length = 4096
    assert fmt.wire_bytes(length) * 8 / length == 3.875  # 3.75 for codes, 0.125 for scales
    assert BlockFormat(4, BLOCK).wire_bytes(length) * 8 / length == 4.125
    x = torch.randn(2, length, generator=torch.Generator().manual_seed(0))
    packets = torch.empty(2, fmt.packet_bytes(length), dtype=torch.uint8)
    blocks.quantize_(x.clone(), packets, fmt, torch.empty_like(x))
    wire = torch.empty(2, fmt.wire_bytes(length), dtype=torch.uint8)
    packing.to_wire_(packets, fmt, length, wire)
    back = torch.zeros_like(packets)
    packing.from_wire_(wire, fmt, length, back)
    assert torch.equal(back, packets)
    scales = fmt.split(packets, length)[1]
    assert torch.equal(wire[:, : 4 * (length // BLOCK)].view(torch.float32), scales)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"packed": True, "bits": 8}, "use bits=4"),
        ({"packed": True, "bits": 4, "block_size": 48}, "multiple of 32"),
        ({"packed": "yes", "bits": 4}, "packed must be True or False"),
    ],
)
def test_packed_options_that_cannot_pack_are_refused_with_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        QuantizationState(None, **options)


# -- through the hook, on ranks --------------------------------------------------------------------
def _gradient(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    n = sum(SIZES)
    return torch.randn(n, generator=gen) * torch.linspace(0.01, 3, n)


def _packed_steps(rank: int, world_size: int) -> dict:
    """The packed hook's result and bytes handed to collectives, step by step."""
    state = QuantizationState(None, bits=4, block_size=BLOCK, packed=True)
    bucket = FakeBucket([torch.zeros(s) for s in SIZES])
    results, sent = [], []
    for step in range(STEPS):
        bucket.set_buffer(_gradient(rank, step))
        with comm.observe_collectives() as seen:
            results.append(quantized_hook(state, bucket).wait().clone())
        sent.append(dict(seen.bytes))
    return {"results": results, "sent": sent}


def _two_phases(world: int) -> list[torch.Tensor]:
    """What the hook computes, step by step, from the quantization math alone: every rank's
    compensated rows quantized at 13 levels, each owner's mean plus its memory quantized
    again, every row decoded (nothing packed: packing must not change a bit)."""
    fmt, numel = BlockFormat(4, BLOCK, packed=True), sum(SIZES)
    length = fmt.row_length(numel, world)
    first = [torch.zeros(world, length) for _ in range(world)]  # each rank's memory
    second = [torch.zeros(1, length) for _ in range(world)]  # each owner's
    results = []
    for step in range(STEPS):
        sent = []
        for rank in range(world):
            rows = torch.zeros(world * length)
            rows[:numel] = _gradient(rank, step)
            first[rank] = rows.view(world, length).add_(first[rank])
            packets = torch.empty(world, fmt.packet_bytes(length), dtype=torch.uint8)
            blocks.quantize_(first[rank], packets, fmt, torch.empty(world, length))
            sent.append(packets)
        owned = []
        for owner in range(world):
            received = torch.stack([sent[rank][owner] for rank in range(world)])
            out, packet = torch.empty(1, length), torch.empty(1, fmt.packet_bytes(length))
            packet = packet.to(torch.uint8)
            blocks.requantize_sum_(
                received, fmt, out, packet, torch.empty(world, length), world,
                memory=second[owner].clone(),
            )  # fmt: skip
            second[owner] = out
            owned.append(packet[0])
        decoded = blocks.dequantize_(torch.stack(owned), fmt, torch.empty(world, length))
        results.append(decoded.view(-1)[:numel].clone())
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_the_packed_hook_gives_the_unpacked_exchanges_bits_and_sends_packed_bytes(world):
    ranks = run_on_ranks(_packed_steps, world, env={"OMP_NUM_THREADS": "1"}, timeout=100)
    expected = _two_phases(world)
    fmt = BlockFormat(4, BLOCK, packed=True)
    length = fmt.row_length(sum(SIZES), world)
    for step in range(STEPS):
        for r in ranks:
            assert torch.equal(r["results"][step], expected[step]), (world, step)
    # The first step, without memories: each element within half a step of each quantization,
    # at most the largest gradient / qmax (6), and not exact.
    gradients = torch.stack([_gradient(rank, 0) for rank in range(world)])
    error = float((expected[0] - gradients.mean(0)).abs().max())
    assert 0 < error <= float(gradients.abs().max()) / 6
    # What each collective is handed: every row to the all-to-all, its own to the all-gather,
    # packed: 15 bytes for 32 codes and 4 for each scale.
    row = length // 32 * 15 + 4 * (length // BLOCK)
    assert ranks[0]["sent"][0] == {"all_to_all_single": world * row, "all_gather_into_tensor": row}


def _both_paths(rank: int, world_size: int) -> dict:
    """Four buckets for two steps (a NaN in bucket 1 at the second), through gloo's path and
    through the one where collectives complete as they are queued (NCCL's)."""
    out = {}
    for inline in (False, True):
        state = QuantizationState(None, bits=4, block_size=BLOCK, packed=True)
        buckets = [FakeBucket([torch.zeros(100 + 50 * i)], index=i, last=i == 3) for i in range(4)]
        for step in range(2):
            grads = [_gradient(rank, step)[: b.buffer().numel()].clone() for b in buckets]
            if step == 1:
                grads[1][5 + rank] = float("nan")
            futures = []
            with comm.completing_inline() if inline else contextlib.nullcontext():
                for bucket, grad in zip(buckets, grads):
                    bucket.set_buffer(grad.clone())
                    futures.append(quantized_hook(state, bucket))
            out[inline, step] = (grads, [f.wait().clone() for f in futures])
    return out


def test_packed_buckets_give_the_same_bits_where_collectives_complete_as_queued():
    ranks = run_on_ranks(_both_paths, 2, env={"OMP_NUM_THREADS": "1"}, timeout=100)
    for out in ranks:
        for step in range(2):
            for queued, gloo in zip(out[True, step][1], out[False, step][1]):
                assert torch.equal(queued.nan_to_num(), gloo.nan_to_num())
        grads, applied = out[True, 1]
        assert not applied[1].isfinite().all()  # the NaN's blocks decode to NaN, as sent
        assert all(bool(torch.isfinite(a).all()) for i, a in enumerate(applied) if i != 1)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][True, 0][1], ranks[1][True, 0][1]))
