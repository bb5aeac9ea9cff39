"""The Triton kernels of block quantization give the eager form's bits.

The kernels run in Triton's interpreter on CPU tensors, in a process of their own
(``triton_interpreted.py``: the interpreter must be on before Triton is first imported, and
other tests import it through PyTorch); each test here compares one case's output with PyTorch's
eager CPU operations, bit for bit (``-0.0`` and ``0.0`` differ). The kernels are also built
for an H100 and an A100 here, without a GPU (``triton_ptx.py``), to check that the compiled
arithmetic is the interpreted one. ``python examples/quantize_passes.py --device cuda --check``
compares the bits on a GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton_interpreted as cases

from commhooks.compress import blocks as quantize
from commhooks.compress import cpu_kernels
from commhooks.compress.blocks import BlockFormat

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
PATH = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case's output from the kernels, run once in Triton's interpreter."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": PATH}
    env.pop("COMMHOOKS_TRITON", None)
    done = subprocess.run(
        [sys.executable, "-m", "triton_interpreted", str(out)],
        env=env, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What the kernels' PTX for an H100 and an A100 holds, built here without a GPU."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    folder = tmp_path_factory.mktemp("ptx")
    env = {**os.environ, "PYTHONPATH": PATH, "TRITON_CACHE_DIR": str(folder / "cache")}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-m", "triton_ptx", str(folder / "counts.pt")],
        env=env, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "counts.pt")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit."""
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _eager_quantize(x, fmt, keep=True, add=None):
    left = x.clone()
    packets = torch.full((x.shape[0], fmt.packet_bytes(x.shape[1])), 7, dtype=torch.uint8)
    with cpu_kernels.disabled():
        quantize.quantize_(left, packets, fmt, torch.empty_like(x), keep_error=keep, add=add)
    return packets, left


def _eager_owner(packets, fmt, world, memory, keep, length=cases.OWNED):
    out = torch.full((1, length), 5.0)
    packet = torch.full((1, fmt.packet_bytes(length)), 7, dtype=torch.uint8)
    scratch = torch.empty(packets.shape[0], length)
    with cpu_kernels.disabled():
        quantize.requantize_sum_(
            packets, fmt, out, packet, scratch, world, memory=memory, keep_error=keep
        )
    return packet, out


@pytest.mark.parametrize("case", cases.QUANTIZE, ids=str)
def test_quantizing_gives_the_eager_bits(interpreted, case):
    bits, block, rows, keep = case
    fmt, x = cases.quantize_input(bits, block, rows)
    packets, left = interpreted[f"quantize {bits} {block} {rows} {keep}"]
    expected_packets, expected_left = _eager_quantize(x, fmt, keep)
    assert torch.equal(packets, expected_packets)
    assert _same(left, expected_left)
    assert keep or _same(left, x)
    assert bool((fmt.split(packets, x.shape[1])[1] > 0).all())  # zeros too: a positive scale


@pytest.mark.parametrize("case", cases.PACKED, ids=str)
def test_thirteen_levels_give_the_eager_bits(interpreted, case):
    rows, keep = case
    fmt = BlockFormat(4, 64, packed=True)
    x = cases.quantize_input(4, 64, rows)[1]
    packets, left = interpreted[f"packed {rows} {keep}"]
    expected_packets, expected_left = _eager_quantize(x, fmt, keep)
    assert torch.equal(packets, expected_packets) and _same(left, expected_left)
    codes = fmt.split(packets, x.shape[1])[0]
    nibbles = torch.cat([codes & 15, codes >> 4])
    assert int(nibbles.min()) == 8 - 6 and int(nibbles.max()) == 8 + 6  # both ends reached


@pytest.mark.parametrize("world", cases.PACKED_OWNER)
def test_the_owners_pass_at_thirteen_levels_gives_the_eager_bits(interpreted, world):
    fmt = BlockFormat(4, 64, packed=True)
    packets = cases.packets_of(fmt, world, cases.OWNED, seed=world, clamp=1e30)
    packet, out = interpreted[f"packed owner {world}"]
    expected_packet, expected_out = _eager_owner(packets, fmt, world, None, True)
    assert torch.equal(packet, expected_packet) and _same(out, expected_out)


@pytest.mark.parametrize("case", cases.ADD, ids=str)
def test_adding_the_error_in_the_same_pass_gives_the_eager_bits(interpreted, case):
    bits, added, keep = case
    fmt, x, add = cases.add_input(bits, added)
    packets, left = interpreted[f"add {bits} {added} {keep}"]
    expected_packets, expected_left = _eager_quantize(x, fmt, bool(keep), add)
    assert torch.equal(packets, expected_packets) and _same(left, expected_left)


@pytest.mark.parametrize("case", cases.DECODE, ids=str)
def test_decoding_and_summing_give_the_eager_bits(interpreted, case):
    bits, rows = case
    fmt = BlockFormat(bits, 64)
    length = fmt.row_length(rows * cases.DECODED, rows)
    packets = cases.packets_of(fmt, rows, length, seed=rows)
    decoded, summed = interpreted[f"decode {bits} {rows}"]
    with cpu_kernels.disabled():
        assert _same(decoded, quantize.dequantize_(packets, fmt, torch.empty(rows, length)))
        scratch = torch.empty(rows, length)
        expected = quantize.dequantize_sum(packets, fmt, scratch, torch.empty(length))
    assert _same(summed[0], expected) and summed.abs().max() > 0


@pytest.mark.parametrize("case", cases.PARTIAL, ids=str)
def test_the_first_elements_of_rows_decode_to_the_eager_bits(interpreted, case):
    bits, columns, dtype = case
    fmt = BlockFormat(bits, 64)
    packets = cases.packets_of(fmt, 2, 192, seed=columns, clamp=6e4)
    with cpu_kernels.disabled():
        out = torch.full((2, columns), 5.0, dtype=getattr(torch, dtype))
        expected = quantize.dequantize_(packets, fmt, out, length=192)
    assert _same(interpreted[f"partial {bits} {columns} {dtype}"], expected)


@pytest.mark.parametrize("case", cases.OWNER, ids=str)
def test_the_owners_pass_gives_the_eager_bits(interpreted, case):
    bits, world, remembered, keep = case
    fmt, packets, memory = cases.owner_input(bits, world, remembered)
    packet, out = interpreted[f"owner {bits} {world} {remembered} {keep}"]
    expected_packet, expected_out = _eager_owner(packets, fmt, world, memory, keep)
    assert torch.equal(packet, expected_packet) and _same(out, expected_out)
    assert _scales_finite(packet, fmt, cases.OWNED)


def test_the_owners_pass_is_the_hooks_sequence_of_eager_steps():
    """``requantize_sum_`` is what the hook's owner does step by step: sum, divide, add the
    remembered error, quantize keeping the new error."""
    fmt = BlockFormat(8, 64)
    packets = cases.packets_of(fmt, 3, 256, seed=9, clamp=1e30)
    memory = torch.randn(200)
    out, packet = torch.empty(1, 256), torch.empty(1, fmt.packet_bytes(256), dtype=torch.uint8)
    quantize.requantize_sum_(packets, fmt, out, packet, torch.empty(3, 256), 3, memory=memory)
    mine = quantize.dequantize_sum(packets, fmt, torch.empty(3, 256), torch.empty(256))
    mine = (mine / 3).view(1, -1)
    mine[0, :200] += memory
    expected_packet, expected_out = _eager_quantize(mine, fmt)
    assert torch.equal(packet, expected_packet) and _same(out, expected_out)


@pytest.mark.parametrize("bits", cases.BITS)
def test_a_non_finite_block_gets_a_non_finite_scale_and_spares_the_others(interpreted, bits):
    fmt = BlockFormat(bits, 16)
    x = cases.non_finite_input()
    packets, left, (owned, _) = interpreted[f"non-finite {bits}"]
    expected_packets, expected_left = _eager_quantize(x, fmt)
    scales = fmt.split(packets, 64)[1]
    assert scales[0, 0].isinf() and scales[1, 2].isnan() and scales[1, 3].isinf()
    finite = scales.isfinite()
    assert int(finite.sum()) == 5
    assert _same(scales[finite], fmt.split(expected_packets, 64)[1][finite])
    blocks = finite.repeat_interleave(16, dim=1)
    assert _same(left[blocks], expected_left[blocks])
    in_finite = blocks if bits == 8 else blocks[:, ::2]  # codes of finite blocks: the same
    codes, expected_codes = fmt.split(packets, 64)[0], fmt.split(expected_packets, 64)[0]
    assert torch.equal(codes[in_finite], expected_codes[in_finite])
    assert not _scales_finite(owned, fmt, 64)  # the owner passes the block on as such


@pytest.mark.parametrize("bits", cases.BITS)
def test_with_cudas_division_scales_are_multiplied_by_the_reciprocal(interpreted, bits):
    """PyTorch's CUDA kernels divide by a host number as a multiplication by its float32
    reciprocal; the kernels do the same on a GPU, and nothing else changes."""
    fmt, x = BlockFormat(bits, 64), cases.values(2, 256, seed=11)
    packets, left, summed, (owned, mean) = interpreted[f"reciprocal {bits}"]
    codes, scales = fmt.split(packets, 256)
    assert torch.equal(codes, fmt.split(_eager_quantize(x, fmt)[0], 256)[0])
    absmax = x.view(2, 4, 64).abs().amax(2).clamp(min=1e-30)
    inverse = float(np.float32(1) / np.float32(fmt.qmax))
    assert _same(scales, absmax * inverse)
    level = torch.round(x.view(2, 4, 64) * (absmax.reciprocal() * fmt.qmax).unsqueeze(2))
    step = scales.repeat_interleave(64, dim=1)
    assert _same(left, torch.addcmul(x, level.view(2, 256), step, value=-1))
    assert _same(mean, summed * float(np.float32(1) / np.float32(3)))  # the owner's mean too
    assert owned.shape == (1, fmt.packet_bytes(256))


@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
def test_on_a_gpu_the_kernels_compute_as_written_and_move_data_in_vectors(compiled, target):
    """Built for a GPU, each kernel's arithmetic is the interpreted one's: correctly rounded
    divisions, no flushing of subnormals, and exactly the fused multiply-adds written (one per
    element for the error and the 4-bit decoding; 16 elements a thread), none contracted by
    the compiler; and the float32 rows move in vector loads and stores."""
    found = {key.split(" ", 1)[1]: v for key, v in compiled.items() if key.startswith(target)}
    assert len(found) == 6
    assert all(counts["approximate"] == 0 for counts in found.values())
    fmas = {name: counts["fma"] for name, counts in found.items()}
    assert fmas == {
        "quantize_kernel 8": 16, "quantize_kernel 4": 16,
        "decode_kernel 8": 0, "decode_kernel 4": 16,
        "requantize_kernel 8": 16, "requantize_kernel 4": 16 + 2 * 16,  # two decodes written
    }  # fmt: skip
    assert all(counts["vector stores"] > 0 for counts in found.values())
    assert found["quantize_kernel 8"]["vector loads"] >= 12  # 3 arrays x 16 floats, 4 a load
    assert found["quantize_kernel 4"]["scalar loads"] == 0


def test_layouts_the_kernels_cannot_read_are_refused(interpreted):
    refusals = interpreted["refusals"]
    assert refusals == [False] * len(refusals)


def _run(script: str, **env: str) -> str:
    environment = {**os.environ, "PYTHONPATH": PATH, **env}
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_and_quantizing_on_a_cpu_leave_triton_unimported():
    script = (
        "import sys, torch, commhooks\n"
        "from commhooks.compress import blocks as quantize\n"
        "fmt = quantize.BlockFormat(8, 64)\n"
        "x = torch.randn(2, 128)\n"
        "packets = torch.empty(2, fmt.packet_bytes(128), dtype=torch.uint8)\n"
        "quantize.quantize_(x, packets, fmt, torch.empty_like(x))\n"
        "quantize.dequantize_(packets, fmt, torch.empty(2, 128))\n"
        "print('triton' in sys.modules)\n"
    )
    assert _run(script).strip() == "False"


def test_commhooks_triton_0_turns_the_kernels_off():
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    script = "from commhooks.compress import triton_launch; print(triton_launch.available())"
    assert _run(script, COMMHOOKS_TRITON="0", TRITON_INTERPRET="1").strip() == "False"
    assert _run(script, TRITON_INTERPRET="1").strip() == "True"


def test_a_triton_whose_division_flushes_subnormals_is_not_used():
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "import triton; triton.__version__ = '3.5.1'\n"
        "from commhooks.compress import triton_launch; print(triton_launch.available())"
    )
    said = _run(script, TRITON_INTERPRET="1")
    assert said.strip().endswith("False") and "older than 3.6" in said, said


def _scales_finite(packets, fmt, length):
    """Whether every scale in ``packets`` is finite (no block held inf or NaN)."""
    return bool(torch.isfinite(fmt.split(packets, length)[1]).all())
