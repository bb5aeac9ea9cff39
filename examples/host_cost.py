"""Host cost of each hook per step, as a ratio to PyTorch's counterpart, on one rank.

On a GPU the host must keep ahead of the device: every Python call and kernel launch a hook
makes per bucket is paid on the host while the device waits for work. With one gloo rank and a
model whose compute is negligible (``--layers`` layers of ``Linear(--width, --width)``), a
step's time over DDP's own step without a hook is that host cost, and many small buckets
multiply it. Every hook gets one DDP model, warmed up past DDP's bucket rebuild (and
PowerSGD's start); then ``--rounds`` rounds each time a block of ``--steps`` steps of every
hook in turn, and a hook's step time is the mean of its fastest fifth of blocks (on a shared
machine a block that another process slowed down is left out; interleaved, every hook meets
the same machine)::

    python examples/host_cost.py --json host_cost.json

prints, per row, each side's step time over no hook and the ratio ours/PyTorch's. ``--clock
cpu`` times steps by this process's CPU time instead of the wall's.

``--backend gloo`` (the default) runs every hook as on a CPU cluster: gloo runs a future's
callbacks on a worker thread of its own, and PyTorch's hooks pay for the interpreter changing
hands at each. ``--backend inline`` measures what a GPU's host pays instead: a backend whose
collectives complete as they are issued, as NCCL's futures do
(:mod:`commhooks.testing.inline_group`), with our hooks inside
:func:`commhooks.comm.completing_inline`, so that they take the GPU's control flow. There the
PowerSGD rows are measured with one bucket and with many; on gloo PyTorch's PowerSGD with
several buckets hangs, so they use one. ``--backend nccl`` measures on a GPU itself (one NCCL
rank, the model on ``cuda:0``): a block's time runs from an idle device to the end of its last
step's work, and with compute this small the device waits for the host, so a step's time over
no hook is again what the hook costs the host (``examples/gpu_check.py`` runs it).

``--ops`` also counts, per step over no hook, the operations each side dispatches (on a GPU,
each is a kernel launch at most; views launch none) and the time ours spends inside
multi-tensor operations (``torch._foreach_*``). A CPU runs those as a loop over their tensors,
one kernel each, where a GPU launches one fused kernel for many tensors: the ratio without that
time is closer to what a GPU's host pays.
"""

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import commhooks
from commhooks import comm
from commhooks.testing import inline_group

Attach = Callable[[DDP], None]
# ``cpu`` counts the processor time of every thread of this process (gloo's included), not
# the time other processes take from it: steadier than ``wall`` on a shared machine.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
MANY_BUCKETS_MB = 0.004
ONE_BUCKET_MB = 4096.0


def _register(name: str, **options: Any) -> Attach:
    return lambda ddp: commhooks.register(ddp, name, **options)


def _torch_hook(hook: Callable[..., Any]) -> Attach:
    return lambda ddp: ddp.register_comm_hook(None, hook)


def _torch_powersgd(ddp: DDP) -> None:
    state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)


_POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}

HOOKS: dict[str, Attach | None] = {
    "no_hook": None,
    "allreduce": _register("allreduce"),
    "torch_allreduce": _torch_hook(torch_default.allreduce_hook),
    "fp16": _register("fp16"),
    "torch_fp16": _torch_hook(torch_default.fp16_compress_hook),
    "bf16": _register("bf16"),
    # The inline backend is not one register() accepts bf16 on: attach the hook itself.
    "bf16_hook": _torch_hook(commhooks.bf16_compress_hook),
    "torch_bf16": _torch_hook(torch_default.bf16_compress_hook),
    "int8": _register("int8"),
    "int4": _register("int4"),
    "power_sgd": _register("power_sgd", **_POWERSGD),
    "power_sgd_single_round": _register("power_sgd_single_round", **_POWERSGD),
    "torch_power_sgd": _torch_powersgd,
}


@dataclass(frozen=True)
class Row:
    """One line of the table: our hook against PyTorch's, at one bucket size, with a goal."""

    ours: str
    theirs: str
    bucket_cap_mb: float
    goal: float  # the highest ratio ours/theirs that meets the goal


ROWS = [
    Row("allreduce", "torch_allreduce", MANY_BUCKETS_MB, 1.0),
    Row("fp16", "torch_fp16", MANY_BUCKETS_MB, 1.0),
    Row("bf16", "torch_fp16", MANY_BUCKETS_MB, 1.0),
    Row("int8", "torch_fp16", MANY_BUCKETS_MB, 1.3),
    Row("int4", "torch_fp16", MANY_BUCKETS_MB, 1.3),
    Row("power_sgd", "torch_power_sgd", ONE_BUCKET_MB, 1.0),
    Row("power_sgd_single_round", "torch_power_sgd", ONE_BUCKET_MB, 1.0),
]
# Where collectives complete as they are queued PyTorch's PowerSGD runs with many buckets too.
# PyTorch's bf16 hook runs only on CUDA with NCCL: elsewhere bf16 is measured against its fp16
# hook. Where collectives complete inline (a GPU's control flow), ours is attached directly, as
# register() would (register() accepts bf16 on gloo and NCCL only).
BF16_INLINE = Row("bf16_hook", "torch_fp16", MANY_BUCKETS_MB, 1.0)
BF16_NCCL = Row("bf16", "torch_bf16", MANY_BUCKETS_MB, 1.0)
MANY_POWERSGD = [
    Row("power_sgd", "torch_power_sgd", MANY_BUCKETS_MB, 1.5),
    Row("power_sgd_single_round", "torch_power_sgd", MANY_BUCKETS_MB, 1.5),
]
ROWS_OF = {
    "gloo": ROWS,
    "inline": [BF16_INLINE if r.ours == "bf16" else r for r in ROWS] + MANY_POWERSGD,
    "nccl": [BF16_NCCL if r.ours == "bf16" else r for r in ROWS] + MANY_POWERSGD,
}


def _model(layers: int, width: int, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device)


def _device(args: argparse.Namespace) -> str:
    return "cuda" if args.backend == "nccl" else "cpu"


def _ddp(args: argparse.Namespace, cap: float) -> DDP:
    """The measured model in DDP, on the backend's device, with buckets of ``cap`` MB."""
    device = _device(args)
    ids = [0] if device == "cuda" else None
    return DDP(_model(args.layers, args.width, device), device_ids=ids, bucket_cap_mb=cap)


def _idle() -> None:
    """Wait until a GPU has run everything queued (nothing to wait for on a CPU)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Run:
    """One hook at one bucket size: a DDP model built and warmed up once (past DDP's bucket
    rebuild and PowerSGD's start), then timed a block of ``--steps`` steps at a time. On the
    inline backend our hooks run inside ``comm.completing_inline()``: a GPU's control flow."""

    def __init__(self, name: str, cap: float, args: argparse.Namespace) -> None:
        self.name, self.args = name, args
        with self._context():
            self.ddp = _ddp(args, cap)
            attach = HOOKS[name]
            if attach is not None:
                attach(self.ddp)
            self.batch = torch.randn(args.batch, args.width, device=_device(args))
            for _ in range(args.warmup):
                self._step()

    def _context(self) -> contextlib.AbstractContextManager[None]:
        inline = self.args.backend == "inline" and not self.name.startswith("torch_")
        return comm.completing_inline() if inline else contextlib.nullcontext()

    def _step(self) -> None:
        self.ddp(self.batch).sum().backward()
        for p in self.ddp.parameters():
            p.grad = None

    def block(self) -> float:
        """Seconds per step over one block of ``--steps`` steps."""
        clock = CLOCKS[self.args.clock]
        with self._context():
            _idle()
            start = clock()
            for _ in range(self.args.steps):
                self._step()
            _idle()
            return (clock() - start) / self.args.steps


def low_fifth(times: list[float]) -> float:
    """The mean of the fastest fifth of ``times`` (at least one): a block that another process
    slowed down is left out, and what remains is the hook's own cost."""
    fastest = sorted(times)[: max(1, len(times) // 5)]
    return statistics.fmean(fastest)


class _OpCounter(TorchDispatchMode):
    """Counts the operations dispatched, and times the multi-tensor ones."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.multi_tensor_s = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        if not func.__name__.startswith("_foreach_"):
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.multi_tensor_s += time.perf_counter() - start
        return out


def count_ops(name: str, cap: float, args: argparse.Namespace) -> tuple[float, float]:
    """Operations dispatched per step by hook ``name``'s DDP step, and seconds per step
    inside multi-tensor operations (on a model of its own, as :class:`Run` times it)."""
    inline = args.backend == "inline" and not name.startswith("torch_")
    counter = _OpCounter()
    with comm.completing_inline() if inline else contextlib.nullcontext():
        ddp = _ddp(args, cap)
        attach = HOOKS[name]
        if attach is not None:
            attach(ddp)
        batch = torch.randn(args.batch, args.width, device=_device(args))
        for step in range(args.warmup + args.steps):
            with counter if step >= args.warmup else contextlib.nullcontext():
                ddp(batch).sum().backward()
            for p in ddp.parameters():
                p.grad = None
    return counter.ops / args.steps, counter.multi_tensor_s / args.steps


def add_ops(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each row's operations per step over no hook, both sides, and the ratio without the
    time ours spends in multi-tensor operations (see the module's note)."""
    for row in rows:
        cap = row["bucket_cap_mb"]
        base, _ = count_ops("no_hook", cap, args)
        ours, multi_s = count_ops(row["hook"], cap, args)
        theirs, _ = count_ops(row["against"], cap, args)
        row["ours_ops"], row["theirs_ops"] = ours - base, theirs - base
        row["ours_multi_tensor_ms"] = multi_s * 1e3
        fused = row["ours_ms"] - row["ours_multi_tensor_ms"]
        row["ratio_fused"] = fused / row["theirs_ms"] if row["theirs_ms"] > 0 else float("inf")


def measure(rows: list[Row], args: argparse.Namespace) -> dict[tuple[str, float], float]:
    """Step time of every (hook, bucket size) the rows need: ``--rounds`` blocks each, the
    hooks' blocks interleaved, summed up by :func:`low_fifth`."""
    names = sorted(
        {(r.ours, r.bucket_cap_mb) for r in rows} | {(r.theirs, r.bucket_cap_mb) for r in rows}
    )
    names += [("no_hook", cap) for cap in sorted({r.bucket_cap_mb for r in rows})]
    runs = {key: Run(*key, args) for key in names}
    blocks: dict[tuple[str, float], list[float]] = {key: [] for key in names}
    for _ in range(args.rounds):
        for key, run in runs.items():
            blocks[key].append(run.block())
    return {key: low_fifth(times) for key, times in blocks.items()}


def table(rows: list[Row], times: dict[tuple[str, float], float]) -> list[dict[str, Any]]:
    """Each row's host time over no hook, both sides, and their ratio."""
    out = []
    for row in rows:
        base = times[("no_hook", row.bucket_cap_mb)]
        ours = times[(row.ours, row.bucket_cap_mb)] - base
        theirs = times[(row.theirs, row.bucket_cap_mb)] - base
        ratio = ours / theirs if theirs > 0 else float("inf")
        out.append(
            {
                "hook": row.ours,
                "against": row.theirs,
                "bucket_cap_mb": row.bucket_cap_mb,
                "ours_ms": ours * 1e3,
                "theirs_ms": theirs * 1e3,
                "ratio": ratio,
                "goal": row.goal,
                "met": ratio <= row.goal,
            }
        )
    return out


def _print(rows: list[dict[str, Any]], buckets: dict[float, int]) -> None:
    head = ("hook", "against", "buckets", "ours ms", "theirs ms", "ratio")
    print("{:24} {:16} {:>7} {:>8} {:>9} {:>6}  goal".format(*head))
    for r in rows:
        mark = "ok" if r["met"] else "MISSED"
        print(
            f"{r['hook']:24} {r['against']:16} {buckets[r['bucket_cap_mb']]:>7} "
            f"{r['ours_ms']:8.3f} {r['theirs_ms']:9.3f} {r['ratio']:6.2f}  "
            f"<= {r['goal']:.2f} {mark}"
        )


def _print_ops(rows: list[dict[str, Any]]) -> None:
    head = ("hook", "against", "ours ops", "theirs ops", "ours _foreach_ ms", "ratio without")
    print("\n{:24} {:16} {:>8} {:>10} {:>17} {:>13}".format(*head))
    for r in rows:
        print(
            f"{r['hook']:24} {r['against']:16} {r['ours_ops']:8.0f} {r['theirs_ops']:10.0f} "
            f"{r['ours_multi_tensor_ms']:17.3f} {r['ratio_fused']:13.2f}"
        )


def bucket_count(cap: float, args: argparse.Namespace) -> int:
    """How many buckets DDP makes of the model at ``cap`` once it has rebuilt them."""
    ddp = _ddp(args, cap)
    seen: set[int] = set()

    def count(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.add(bucket.index())
        buffer = bucket.buffer()
        devices = [buffer.device] if buffer.is_cuda else None  # a CUDA value needs its device
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
        fut.set_result(buffer)
        return fut

    ddp.register_comm_hook(None, count)
    for _ in range(2):
        seen.clear()
        ddp(torch.randn(2, args.width, device=_device(args))).sum().backward()
    return len(seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="steps in a timed block")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20, help="timed blocks of each hook")
    parser.add_argument("--json", help="also write the table to this file")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or this process's CPU time",
    )
    parser.add_argument(
        "--only", help="comma-separated hooks of ours: measure only their rows", default=""
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="also count operations per step and the time in multi-tensor operations",
    )
    parser.add_argument(
        "--backend",
        choices=sorted(ROWS_OF),
        default="gloo",
        help="gloo; a backend that completes collectives as NCCL does (a GPU's host cost); "
        "or NCCL on one GPU",
    )
    args = parser.parse_args(argv)
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl needs a CUDA device; use --backend inline on a CPU")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.backend == "inline":
            inline_group.init()
        else:
            if args.backend == "nccl":
                torch.cuda.set_device(0)
            store = dist.FileStore(os.path.join(tmp, "store"), 1)
            dist.init_process_group(args.backend, store=store, rank=0, world_size=1)
        try:
            rows_of = ROWS_OF[args.backend]
            chosen = [r for r in rows_of if not args.only or r.ours in args.only.split(",")]
            buckets = {cap: bucket_count(cap, args) for cap in {r.bucket_cap_mb for r in chosen}}
            rows = table(chosen, measure(chosen, args))
            for row in rows:
                row["buckets"] = buckets[row["bucket_cap_mb"]]
            if args.ops:
                add_ops(rows, args)
        finally:
            dist.destroy_process_group()
    _print(rows, buckets)
    if args.ops:
        _print_ops(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
