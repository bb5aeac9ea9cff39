"""The fused C kernels of block quantization: built on first use, the same bits as PyTorch's
eager operations, and never needed (every fallback computes the same result)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commhooks import QuantizationState, quantized_hook
from commhooks.compress import blocks as quantize
from commhooks.compress import cpu_kernels
from commhooks.compress.blocks import BlockFormat
from commhooks.testing import run_on_ranks

HAS_COMPILER = any(shutil.which(name) for name in ("cc", "gcc", "clang"))
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine")
# The processes started here import this checkout's package, wherever it is installed from.
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _hostile(rows: int, length: int, seed: int) -> torch.Tensor:
    """Rows whose blocks span 1e-40 to 1e30, with a block of zeros and one of subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, length, generator=gen)
    x *= torch.logspace(-40, 30, rows * length)[torch.randperm(rows * length, generator=gen)].view(
        rows, length
    )
    x.view(-1)[:8] = 0.0
    x.view(-1)[8:16] = 1e-44
    x.view(-1)[16:24] = -torch.finfo(torch.float32).max
    return x


def _both(fn):
    """``fn()`` with the fused kernels, and again with PyTorch's eager operations."""
    fused = fn()
    with cpu_kernels.disabled():
        eager = fn()
    return fused, eager


def _encode(x, fmt, keep_error=True):
    left = x.clone()
    packets = torch.full((x.shape[0], fmt.packet_bytes(x.shape[1])), 7, dtype=torch.uint8)
    quantize.quantize_(left, packets, fmt, torch.empty_like(x), keep_error=keep_error)
    return packets, left


@needs_compiler
def test_the_kernels_build_on_first_use_and_are_loaded_from_the_cache_after(tmp_path):
    cache = tmp_path / "cache"
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from commhooks.compress import cpu_kernels; print('available', cpu_kernels.available())"
    )
    env = {**os.environ, "PYTHONPATH": SRC, "COMMHOOKS_CACHE_DIR": str(cache)}
    env.pop("COMMHOOKS_NATIVE", None)
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert "available True" in first.stdout and "built the fused" in first.stdout, first
    built = list(cache.glob("kernels-*.so"))
    assert len(built) == 1 and not list(cache.glob("tmp*"))  # no scratch left behind
    again = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert "available True" in again.stdout and "built" not in again.stdout, again


@needs_compiler
def test_a_damaged_build_in_the_cache_is_built_again(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": SRC, "COMMHOOKS_CACHE_DIR": str(cache)}
    script = (
        "from commhooks.compress import cpu_kernels; print('available', cpu_kernels.available())"
    )
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True)
    (built,) = cache.glob("kernels-*.so")
    built.write_bytes(built.read_bytes()[:100])  # truncated: the loader refuses it
    again = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert "available True" in again.stdout, again
    assert len(built.read_bytes()) > 1000


@needs_compiler
def test_ranks_building_at_once_all_load_one_build(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": SRC, "COMMHOOKS_CACHE_DIR": str(cache)}
    script = "from commhooks.compress import cpu_kernels; assert cpu_kernels.available()"
    started = [subprocess.Popen([sys.executable, "-c", script], env=env) for _ in range(4)]
    assert [p.wait(timeout=120) for p in started] == [0, 0, 0, 0]
    assert len(list(cache.glob("kernels-*.so"))) == 1


@pytest.mark.parametrize(
    "env",
    [{"COMMHOOKS_NATIVE": "0"}, {"CC": "/bin/false"}, {"CC": "no-such-compiler"}],
    ids=["turned-off", "compiler-fails", "no-compiler"],
)
def test_without_the_kernels_quantization_still_works_and_says_why(tmp_path, env):
    script = (
        "import logging, sys, torch; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from commhooks.compress import blocks as quantize, cpu_kernels\n"
        "fmt = quantize.BlockFormat(8, 8); x = torch.arange(16.0).view(1, 16)\n"
        "p = torch.empty(1, fmt.packet_bytes(16), dtype=torch.uint8)\n"
        "quantize.quantize_(x, p, fmt, torch.empty_like(x))\n"
        "print('available', cpu_kernels.available(), 'scales', fmt.split(p, 16)[1].tolist())"
    )
    full = {**os.environ, "PYTHONPATH": SRC, "COMMHOOKS_CACHE_DIR": str(tmp_path / "empty"), **env}
    done = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "available False" in done.stdout
    assert "eager operations" in done.stdout  # the log says what runs instead, and why
    assert "scales [[0.05511811" in done.stdout  # 7 / 127 and 15 / 127: it still quantized
    assert not list((tmp_path / "empty").glob("*.so"))


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [8, 64, 256, 1040])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("keep_error", [True, False])
def test_quantizing_gives_pytorchs_bits(bits, block, rows, keep_error):
    assert cpu_kernels.available()
    fmt = BlockFormat(bits, block)
    length = fmt.row_length(rows * (3 * block + 5), rows)
    x = _hostile(rows, length, seed=bits + block + rows)
    (fused_packets, fused_left), (eager_packets, eager_left) = _both(
        lambda: _encode(x, fmt, keep_error)
    )
    assert torch.equal(fused_packets, eager_packets)
    assert torch.equal(fused_left, eager_left)  # the error kept, bit for bit
    assert keep_error or torch.equal(fused_left, x)


@needs_compiler
@pytest.mark.parametrize("block", [32, 64, 256])
@pytest.mark.parametrize("keep_error", [True, False])
def test_quantizing_to_thirteen_levels_gives_pytorchs_bits(block, keep_error):
    fmt = BlockFormat(4, block, packed=True)
    length = fmt.row_length(3 * (3 * block + 5), 3)
    x = _hostile(3, length, seed=block)
    (fused_packets, fused_left), (eager_packets, eager_left) = _both(
        lambda: _encode(x, fmt, keep_error)
    )
    assert torch.equal(fused_packets, eager_packets)
    assert torch.equal(fused_left, eager_left)
    codes = fmt.split(fused_packets, length)[0]
    nibbles = torch.cat([codes & 15, codes >> 4])
    assert int(nibbles.min()) == 8 - 6 and int(nibbles.max()) == 8 + 6  # qmax 6, both ends


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("added", [0, 1, 63, 64, 1000, 3 * 448])
def test_adding_the_error_in_the_same_pass_gives_pytorchs_bits(bits, added):
    fmt = BlockFormat(bits, 64)
    x = _hostile(3, 448, seed=added)
    # halved, so that their sum stays finite where both hold -max
    first, second = (_hostile(1, added, seed=seed).view(-1) / 2 for seed in (1, 2))

    def encode():
        left = x.clone()
        packets = torch.empty(3, fmt.packet_bytes(448), dtype=torch.uint8)
        quantize.quantize_(left, packets, fmt, torch.empty_like(x), add=(first, second))
        return packets, left

    (fused, fused_left), (eager, eager_left) = _both(encode)
    assert torch.equal(fused, eager) and torch.equal(fused_left, eager_left)
    expected = x.clone()
    expected.view(-1)[:added] = first + second
    assert torch.equal(fused, _encode(expected, fmt)[0])  # the sum, then quantized
    assert not cpu_kernels.quantize_rows(x.clone(), fused, bits, 64, True, (first, second.double()))


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_decoding_and_summing_give_pytorchs_bits(bits, rows):
    fmt = BlockFormat(bits, 64)
    length = fmt.row_length(rows * 1000, rows)
    packets, _ = _encode(_hostile(rows, length, seed=rows), fmt)
    decoded = _both(lambda: quantize.dequantize_(packets, fmt, torch.empty(rows, length)))
    assert torch.equal(*decoded)
    scratch = torch.empty(rows, length)
    summed = _both(lambda: quantize.dequantize_sum(packets, fmt, scratch, torch.empty(length)))
    assert torch.equal(*summed)
    assert summed[0].abs().max() > 0


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("columns", [0, 1, 63, 64, 65, 191])
def test_the_first_elements_of_rows_decode_to_pytorchs_bits(bits, columns):
    fmt = BlockFormat(bits, 64)
    packets, _ = _encode(_hostile(2, 192, seed=columns), fmt)
    whole = quantize.dequantize_(packets, fmt, torch.empty(2, 192))
    for scratch in (None, torch.empty(2, 192)):
        part = _both(
            lambda s=scratch: quantize.dequantize_(
                packets, fmt, torch.full((2, columns), 5.0), length=192, scratch=s
            )
        )
        assert torch.equal(part[0], whole[:, :columns]) and torch.equal(part[1], part[0])


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("keep", [True, False])
def test_calls_bound_to_their_tensors_give_the_unbound_calls_bits(bits, keep):
    fmt = BlockFormat(bits, 64)
    rows, length = 3, fmt.row_length(3 * 400, 3)
    x = _hostile(rows, length, seed=bits)
    first, second = (_hostile(1, 500, seed=seed).view(-1) / 2 for seed in (3, 4))
    packets = torch.empty(rows, fmt.packet_bytes(length), dtype=torch.uint8)
    bound_x, unbound_x = x.clone(), x.clone()
    bound = cpu_kernels.bound_quantize(bound_x, packets, bits, 64, keep, fmt.qmax)
    assert bound is not None and bound((first, second))
    expected = torch.empty_like(packets)
    assert cpu_kernels.quantize_rows(unbound_x, expected, bits, 64, keep, (first, second), fmt.qmax)
    assert torch.equal(packets, expected) and torch.equal(bound_x, unbound_x)
    assert bound(None)  # without an addition: the rows as they are now
    assert cpu_kernels.quantize_rows(unbound_x, expected, bits, 64, keep, None, fmt.qmax)
    assert torch.equal(packets, expected) and torch.equal(bound_x, unbound_x)
    assert not bound((first, second.double()))  # an addend it cannot take: nothing done
    summed, out = torch.empty(1, length), torch.empty(1, length)
    adding = cpu_kernels.bound_dequantize(packets, bits, 64, summed, add_rows=True)
    assert adding is not None and adding()
    assert cpu_kernels.dequantize_rows(packets, bits, 64, out, add_rows=True)
    assert torch.equal(summed, out)
    with cpu_kernels.disabled():  # off: the bound calls do nothing and say so
        assert not bound(None) and not adding()
    # Tensors the kernels cannot take are not bound at all.
    assert cpu_kernels.bound_quantize(x.double(), packets, bits, 64, keep, fmt.qmax) is None
    assert cpu_kernels.bound_dequantize(packets, bits, 64, torch.empty(2, length)) is None


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_a_bound_call_checks_each_new_pair_of_addends_and_adds_in_place(bits):
    # The pair a call took last is not checked again; any other pair is, even after a pair
    # that fitted; and the first addend may be the rows themselves (the owner's memory added
    # in place), with the bits of adding first and quantizing after.
    fmt = BlockFormat(bits, 64)
    length = fmt.row_length(300, 1)
    packets, expected = (torch.empty(1, fmt.packet_bytes(length), dtype=torch.uint8) for _ in "ab")
    generator = torch.Generator().manual_seed(bits)
    x, memory = (torch.randn(1, length, generator=generator) * 3 for _ in "xm")
    bound_x, eager_x = x.clone(), x.clone()
    bound = cpu_kernels.bound_quantize(bound_x, packets, bits, 64, True, fmt.qmax)
    assert bound is not None
    for _ in range(2):  # the second call finds the pair it checked: the same bits again
        bound_x.copy_(x)
        assert bound((bound_x, memory))
        eager_x.copy_(x).add_(memory)
        assert cpu_kernels.quantize_rows(eager_x, expected, bits, 64, True, None, fmt.qmax)
        assert torch.equal(packets, expected) and torch.equal(bound_x, eager_x)
    half = length // 2
    gradient, kept = torch.randn(length), torch.randn(length)
    assert bound((gradient, kept))
    kept.resize_(half)  # the same pair, one of them shorter now: checked again, refused
    assert not bound((gradient, kept))
    assert not bound((bound_x, memory[:, :-1]))  # a new pair of another length: refused
    strided = memory.view(-1)[::2][:half]
    assert not bound((bound_x.view(-1)[:half], strided))  # a strided addend: refused
    bound_x.copy_(x)  # a shorter pair that fits: only the first elements are added
    assert bound((bound_x.view(-1)[:half], memory.view(-1)[:half]))
    eager_x.copy_(x).view(-1)[:half].add_(memory.view(-1)[:half])
    assert cpu_kernels.quantize_rows(eager_x, expected, bits, 64, True, None, fmt.qmax)
    assert torch.equal(packets, expected) and torch.equal(bound_x, eager_x)


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_several_threads_give_the_same_bits(bits):
    fmt = BlockFormat(bits, 256)
    length = fmt.row_length(3_000_000, 2)
    x = _hostile(2, length, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # more threads than this machine's cores: slices still line up
    try:
        (fused_packets, fused_left), (eager_packets, eager_left) = _both(lambda: _encode(x, fmt))
        decoded = _both(lambda: quantize.dequantize_(fused_packets, fmt, torch.empty_like(x)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(fused_packets, eager_packets) and torch.equal(fused_left, eager_left)
    assert torch.equal(*decoded)


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_a_non_finite_block_gets_a_non_finite_scale_and_spares_the_others(bits):
    fmt = BlockFormat(bits, 16)
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    (fused, fused_left), (eager, eager_left) = _both(lambda: _encode(x, fmt))
    scales = fmt.split(fused, 64)[1]
    assert scales[0, 0].isinf() and scales[1, 2].isnan()
    assert not _scales_finite(fused, fmt, 64)
    finite = scales.isfinite()
    assert int(finite.sum()) == 6
    assert torch.equal(scales[finite], fmt.split(eager, 64)[1][finite])
    blocks = finite.repeat_interleave(16, dim=1)
    assert torch.equal(fused_left[blocks], eager_left[blocks])


def test_layouts_the_kernels_cannot_read_take_the_eager_form():
    fmt = BlockFormat(8, 8)
    x = torch.randn(2, 32)
    packets = torch.empty(2, fmt.packet_bytes(32), dtype=torch.uint8)
    assert not cpu_kernels.quantize_rows(x.t().contiguous().t(), packets, 8, 8, True)  # strided
    assert not cpu_kernels.quantize_rows(x.double(), packets, 8, 8, True)
    assert not cpu_kernels.quantize_rows(x, packets[:, :-4], 8, 8, True)  # packets too short
    assert not cpu_kernels.quantize_rows(x[:, :30], packets, 8, 8, True)  # not whole blocks
    assert not cpu_kernels.dequantize_rows(packets, 8, 8, torch.empty(2, 32, dtype=torch.float16))
    # ...and the public functions still give the same result through the eager form
    strided = torch.empty(32, 2).t()
    strided.copy_(x)
    packets_strided, left_strided = _encode(strided, fmt)
    with cpu_kernels.disabled():
        packets_eager, left_eager = _encode(x, fmt)
    assert torch.equal(packets_strided, packets_eager) and torch.equal(left_strided, left_eager)


def _step_on_ranks(rank: int, world_size: int, eager_ranks: tuple[int, ...]) -> tuple:
    """Three quantized steps of a bucket of odd length; some ranks without the kernels."""
    if rank in eager_ranks:
        os.environ["COMMHOOKS_NATIVE"] = "0"  # read when the kernels are first wanted
    from ddp_utils import FakeBucket

    averages, states = [], []
    for bits in (8, 4):
        state = QuantizationState(None, bits=bits, block_size=64)
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * rank + step)
            bucket = FakeBucket([torch.randn(5003, generator=gen) * (1 + rank)])
            averages.append(quantized_hook(state, bucket).wait().clone())
        states.append(state.state_dict())
    return averages, states, cpu_kernels.available()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@needs_compiler
def test_ranks_with_and_without_the_kernels_stay_in_sync_bitwise():
    mixed = run_on_ranks(_step_on_ranks, 3, (1,))
    fused = run_on_ranks(_step_on_ranks, 3, ())
    assert [m[2] for m in mixed] == [True, False, True]
    for rank in range(3):
        assert _same(mixed[rank][:2], fused[rank][:2])  # averages and memories, bit for bit
        assert _same(mixed[rank][0], mixed[0][0])  # the same average on every rank


def _hostile_for_bfloat16(n: int, seed: int) -> torch.Tensor:
    """float32 values spanning bfloat16's range, with every kind of rounding case: ties to even
    both ways, values that round up to infinity, subnormals, zeros, infinities and NaNs."""
    x = _hostile(1, n, seed).view(-1)
    gen = torch.Generator().manual_seed(seed)
    picked = torch.randperm(n, generator=gen)[: n // 4]
    bits = x.view(torch.int32)
    bits[picked[0::3]] = (bits[picked[0::3]] & ~0xFFFF) | 0x8000  # halfway: ties
    bits[picked[1::3]] = (bits[picked[1::3]] & ~0xFFFF) | 0x7FFF  # just below halfway
    x[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38])  # 3.4e38 -> inf
    x[24:28] = torch.tensor([-0.0, 1e-45, -3e-39, 3.3e38])
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (their payloads may differ)."""
    equal = a.view(torch.int16) == b.view(torch.int16)
    return bool((equal | (a.isnan() & b.isnan())).all())


@needs_compiler
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("n", [37, 1003, 600_001])  # the last one is cut among threads
def test_casting_to_bfloat16_and_dividing_gives_pytorchs_bits(world, n):
    x = _hostile_for_bfloat16(n, seed=world + n)
    out = torch.full((n,), 7.0, dtype=torch.bfloat16)
    assert cpu_kernels.bfloat16_scaled(x, out, world)
    assert _same_bits(out, x.to(torch.bfloat16).div_(world))


def test_bfloat16_layouts_the_kernels_cannot_read_take_the_eager_form():
    x, out = torch.randn(64), torch.empty(64, dtype=torch.bfloat16)
    assert not cpu_kernels.bfloat16_scaled(x[::2], out[:32], 2)  # strided
    assert not cpu_kernels.bfloat16_scaled(x.double(), out, 2)
    assert not cpu_kernels.bfloat16_scaled(x, out.half(), 2)
    assert not cpu_kernels.bfloat16_scaled(x[:63], out, 2)  # lengths differ
    assert not cpu_kernels.bfloat16_scaled(x.clone().requires_grad_(), out, 2)
    assert not cpu_kernels.bfloat16_scaled(x, out, 0)
    with cpu_kernels.disabled():
        assert not cpu_kernels.bfloat16_scaled(x, out, 2)


def _bf16_steps_on_ranks(rank: int, world_size: int, eager_ranks: tuple[int, ...]) -> tuple:
    """bf16-averaged buckets, one plain, one with a value that overflows bfloat16 and one with
    a NaN gradient; some ranks eager."""
    if rank in eager_ranks:
        os.environ["COMMHOOKS_NATIVE"] = "0"  # read when the kernels are first wanted
    from ddp_utils import FakeBucket

    from commhooks import bf16_compress_hook

    averages = []
    for case in ("plain", "overflow", "nan"):
        gen = torch.Generator().manual_seed(10 * rank + len(case))
        grad = torch.randn(300_007, generator=gen) * (1 + rank)
        if case == "overflow":
            grad[5] = 3.4e38  # its cast is inf, as PyTorch's
        if case == "nan" and rank == world_size - 1:
            grad[9] = float("nan")
        averages.append(bf16_compress_hook(None, FakeBucket([grad])).wait().clone())
    return averages, cpu_kernels.available()


@needs_compiler
@pytest.mark.parametrize("world", [2, 3])
def test_the_bf16_hook_gives_the_same_bits_with_and_without_the_kernels(world):
    fused = run_on_ranks(_bf16_steps_on_ranks, world, ())
    eager = run_on_ranks(_bf16_steps_on_ranks, world, tuple(range(world)))
    mixed = run_on_ranks(_bf16_steps_on_ranks, world, (1,))
    assert [f[1] for f in fused] == [True] * world and not any(e[1] for e in eager)
    for rank in range(world):
        for ours, theirs, either in zip(fused[rank][0], eager[rank][0], mixed[rank][0]):
            assert _same_bits(ours.view(torch.bfloat16), theirs.view(torch.bfloat16))
            assert _same_bits(ours.view(torch.bfloat16), either.view(torch.bfloat16))
    plain, overflow, nan = fused[0][0]
    assert plain.isfinite().all() and nan[9].isnan()
    assert overflow[5].isposinf() and overflow.isfinite().sum() == overflow.numel() - 1


def _scales_finite(packets, fmt, length):
    """Whether every scale in ``packets`` is finite (no block held inf or NaN)."""
    return bool(torch.isfinite(fmt.split(packets, length)[1]).all())
