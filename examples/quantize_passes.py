"""Cost of the quantized hook's passes against the memory-bound floor, and a check of their bits.

The floor is one pass that reads and writes the whole float32 bucket (``out.copy_(x)``; an
elementwise ``torch.add`` of two buckets is shown too). Each pass of
:mod:`commhooks.compress.blocks` runs over the same bucket, as the hook runs it (one row per rank,
error kept), in one process, one thread by default; the measurements alternate round by round,
so that other load on the machine falls on all of them alike, and each reports its median, the
bytes it must move over its time (GB/s), and that rate against the copy's. With ``--device
cuda`` the same passes run on the GPU (in the Triton kernels where Triton is installed, beside
PyTorch's eager form), each timed to its end on the device::

    python examples/quantize_passes.py --numel 6000000 --rounds 50 --ranks 2
    python examples/quantize_passes.py --device cuda --numel 50000000 --rounds 30 --ranks 8

``--check`` instead compares the fused kernels' bits with the eager form's on the device, and
with the eager form on the CPU, and exits 1 if a pass differs from its own device's eager form::

    python examples/quantize_passes.py --device cuda --check --numel 4000000
"""

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

from commhooks.compress import blocks as quantize
from commhooks.compress import cpu_kernels, triton_launch

Pass = tuple[Callable[[], object], int]  # the pass, and the bytes it must read and write


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """PyTorch's eager form: the fused CPU and GPU kernels turned off."""
    with cpu_kernels.disabled(), triton_launch.disabled():
        yield


def _in_form(fn: Callable[[], object], fused: bool) -> Callable[[], None]:
    """``fn`` as it runs by default, or with the fused kernels turned off."""

    def run() -> None:
        with contextlib.nullcontext() if fused else _eager():
            fn()

    return run


def _passes(x: torch.Tensor, ranks: int, bits: int, block: int, fused: bool) -> dict[str, Pass]:
    """The hook's passes over bucket ``x`` at ``bits``: the sender's quantizing (the usual
    step's, with the remembered error added in), the owner's pass and the decoding."""
    fmt = quantize.BlockFormat(bits, block)
    numel, length = x.numel(), fmt.row_length(x.numel(), ranks)
    rows = torch.zeros(ranks, length, device=x.device)
    memory, levels = torch.randn_like(rows), torch.empty_like(rows)
    packets = torch.empty(ranks, fmt.packet_bytes(length), dtype=torch.uint8, device=x.device)
    mine = torch.empty(1, length, device=x.device)
    own = torch.empty(1, fmt.packet_bytes(length), dtype=torch.uint8, device=x.device)
    owner_memory = torch.randn(length, device=x.device)
    decoded = torch.empty_like(rows)
    added = (x, memory.view(-1)[:numel])
    quantize.quantize_(rows, packets, fmt, levels, add=added)  # codes for the later passes
    wire = packets.numel()

    def encode() -> None:
        quantize.quantize_(rows, packets, fmt, levels, add=added)

    def owner() -> None:
        quantize.requantize_sum_(packets, fmt, mine, own, levels, ranks, memory=owner_memory)

    def decode() -> None:
        quantize.dequantize_(packets, fmt, decoded)

    form = "" if fused else ", eager"
    return {
        f"int{bits} quantize + error add{form}": (_in_form(encode, fused), 12 * numel + wire),
        f"int{bits} owner's pass{form}": (
            _in_form(owner, fused),
            wire + 8 * length + wire // ranks,
        ),
        f"int{bits} dequantize{form}": (_in_form(decode, fused), wire + 4 * ranks * length),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=6_000_000, help="bucket elements")
    parser.add_argument("--ranks", type=int, default=2, help="rows the bucket is cut into")
    parser.add_argument("--block", type=int, default=256, help="elements per scale")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU")
    parser.add_argument("--check", action="store_true", help="compare bits, do not time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.check:
        sys.exit(0 if check(device, args.block, args.numel) else 1)
    time_passes(device, args.numel, args.ranks, args.block, args.rounds)


def time_passes(device: torch.device, numel: int, ranks: int, block: int, rounds: int) -> None:
    """Print each pass's median time, GB/s, and rate against one copy of the bucket."""
    fused = cpu_kernels.available() if device.type == "cpu" else triton_launch.available()
    # Each pass as the hook runs it; with the fused kernels, their eager form beside.
    forms = (True, False) if fused else (False,)
    x = torch.randn(numel, device=device)
    other, out = torch.randn_like(x), torch.empty_like(x)
    passes: dict[str, Pass] = {
        "floor: copy (read + write once)": (lambda: out.copy_(x), 8 * numel),
        "torch.add (read 2, write 1)": (lambda: torch.add(x, other, out=out), 12 * numel),
    }
    for bits in (8, 4):
        for as_is in forms:
            passes.update(_passes(x, ranks, bits, block, as_is))
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(rounds):
        for name, (fn, _) in passes.items():
            times[name].append(_timed(fn, device))
    floor = statistics.median(times["floor: copy (read + write once)"])
    copy_rate = 8 * numel / floor
    kernels = ("C kernels" if device.type == "cpu" else "Triton kernels") if fused else "eager"
    print(f"{numel} float32 elements on {device}, {ranks} rows, blocks of {block}, {kernels}:")
    for name, measured in times.items():
        median, moved = statistics.median(measured), passes[name][1]
        rate = moved / median
        print(
            f"  {name:36s} {median * 1e3:8.3f} ms  {median / floor:5.2f}x copy time  "
            f"{rate / 1e9:7.1f} GB/s  {rate / copy_rate:5.0%} of copy's GB/s"
        )


def _hostile(rows: int, length: int, device: torch.device) -> torch.Tensor:
    """Values spanning 1e-30 to 1e20, with blocks of zeros, subnormals and equal values."""
    gen = torch.Generator().manual_seed(rows + length)
    x = torch.randn(rows, length, generator=gen)
    x *= torch.logspace(-30, 20, rows * length)[torch.randperm(rows * length, generator=gen)].view(
        rows, length
    )
    x.view(-1)[:64], x.view(-1)[64:128], x.view(-1)[-64:] = 0.0, 1e-44, 2.5
    return x.to(device)


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ bit for bit."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    bits = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return int((a.view(bits) != b.view(bits)).sum())


def _outputs(x: torch.Tensor, fmt: quantize.BlockFormat, ranks: int) -> dict[str, torch.Tensor]:
    """Every pass's output on ``x`` (``ranks`` rows), in the current form and device."""
    rows, length = x.shape
    memory = torch.randn(rows * length, generator=torch.Generator().manual_seed(1)).to(x.device)
    gradient = x.reshape(-1) - memory
    left = torch.empty_like(x)
    packets = torch.empty(rows, fmt.packet_bytes(length), dtype=torch.uint8, device=x.device)
    levels = torch.empty_like(x)
    quantize.quantize_(left, packets, fmt, levels, add=(gradient, memory))
    decoded = quantize.dequantize_(packets, fmt, torch.empty_like(x))
    summed = quantize.dequantize_sum(packets, fmt, levels, torch.empty(length, device=x.device))
    mine = torch.empty(1, length, device=x.device)
    own = torch.empty(1, fmt.packet_bytes(length), dtype=torch.uint8, device=x.device)
    owner_memory = memory[: length - 3] / 8
    quantize.requantize_sum_(packets, fmt, mine, own, levels, ranks, memory=owner_memory)
    half = torch.empty(rows, length, dtype=torch.bfloat16, device=x.device)
    quantize.dequantize_(packets, fmt, half)
    return {
        "packets": packets, "error": left, "decoded": decoded, "bf16 decoded": half,
        "sum": summed, "owner's packet": own, "owner's error": mine,
    }  # fmt: skip


def check(device: torch.device, block: int, numel: int) -> bool:
    """Compare the fused kernels' bits with the eager form's on ``device`` (and on the CPU),
    on buckets of about ``numel`` elements cut into 2, 4 and 8 rows; print each comparison;
    whether every pass matched its device's eager form."""
    fused = cpu_kernels.available() if device.type == "cpu" else triton_launch.available()
    print(f"{device}: fused kernels {'on' if fused else 'missing: nothing to compare'}")
    matched = True
    for bits in (8, 4):
        for ranks in (2, 4, 8):
            fmt = quantize.BlockFormat(bits, block)
            x = _hostile(ranks, fmt.row_length(numel, ranks), device)
            got = _outputs(x, fmt, ranks)
            with _eager():
                same_device = _outputs(x, fmt, ranks)
                on_cpu = _outputs(x.cpu(), fmt, ranks) if device.type != "cpu" else same_device
            for name, value in got.items():
                here, cpu = _differ(value, same_device[name]), _differ(value, on_cpu[name])
                matched &= here == 0
                print(
                    f"  int{bits} {ranks} rows {name:15s} differs from eager on {device.type}"
                    f" at {here} of {value.numel()}, from eager on cpu at {cpu}"
                )
    print("every pass gives its device's eager bits" if matched else "MISMATCH")
    return matched


if __name__ == "__main__":
    main()
