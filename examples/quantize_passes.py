"""Cost of the quantized hook's quantize and dequantize passes against the memory-bound floor.

The floor is one pass that reads and writes the whole float32 bucket (``out.copy_(x)``; an
elementwise ``torch.add`` of two buckets is shown too). Each pass of
:mod:`commhooks.quantize` runs over the same bucket, as the hook runs it (one row per rank,
error kept), in one process, one thread by default; the measurements alternate round by round,
so that other load on the machine falls on all of them alike, and each reports its median.
With ``--device cuda`` the same passes run on the GPU, each timed to its end on the device::

    python examples/quantize_passes.py --numel 6000000 --rounds 50 --ranks 2
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from commhooks import _kernels, quantize


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _in_form(fn: Callable[[], None], fused: bool) -> Callable[[], None]:
    """``fn`` as it runs by default, or with the fused CPU kernels turned off."""
    if fused:
        return fn

    def eager() -> None:
        with _kernels.disabled():
            fn()

    return eager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=6_000_000, help="bucket elements")
    parser.add_argument("--ranks", type=int, default=2, help="rows the bucket is cut into")
    parser.add_argument("--block", type=int, default=256, help="elements per scale")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    fused = device.type == "cpu" and _kernels.available()
    # Each pass as the hook runs it; on a CPU with the fused kernels, their eager form beside.
    forms = [("", True), (", eager", False)] if fused else [("", True)]
    x = torch.randn(args.numel, device=device)
    other, out = torch.randn_like(x), torch.empty_like(x)
    passes: dict[str, Callable[[], object]] = {
        "floor: copy (read + write once)": lambda: out.copy_(x),
        "torch.add (read 2, write 1)": lambda: torch.add(x, other, out=out),
    }
    for bits in (8, 4):
        fmt = quantize.BlockFormat(bits, args.block)
        length = fmt.row_length(args.numel, args.ranks)
        rows = torch.zeros(args.ranks, length, device=device)
        rows.view(-1)[: args.numel].copy_(x)
        levels = torch.empty_like(rows)
        packets = torch.empty(
            args.ranks, fmt.packet_bytes(length), dtype=torch.uint8, device=device
        )
        decoded = torch.empty_like(rows)

        def encode(rows=rows, packets=packets, fmt=fmt, levels=levels) -> None:
            quantize.quantize_(rows, packets, fmt, levels)

        def decode(packets=packets, fmt=fmt, decoded=decoded) -> None:
            quantize.dequantize_(packets, fmt, decoded)

        for form, as_is in forms:
            passes[f"int{bits} quantize (error kept){form}"] = _in_form(encode, as_is)
            passes[f"int{bits} dequantize{form}"] = _in_form(decode, as_is)
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(args.rounds):
        for name, fn in passes.items():
            times[name].append(_timed(fn, device))
    floor = statistics.median(times["floor: copy (read + write once)"])
    kernels = "fused kernels" if fused else "PyTorch's eager operations"
    print(
        f"{args.numel} float32 elements on {device}, {args.ranks} rows, "
        f"blocks of {args.block}, {kernels}:"
    )
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"  {name:41s} {median * 1e3:8.2f} ms  {median / floor:5.2f}x floor")


if __name__ == "__main__":
    main()
