"""Step time and peak GPU memory of each hook, ours against PyTorch's, on this machine's GPUs.

One rank per GPU over NCCL. ``python examples/gpu_step_time.py`` runs one rank (with one GPU
there is nothing to communicate, so this measures what each hook costs the device and the
host around the collectives); ``torchrun --nproc_per_node N examples/gpu_step_time.py`` runs
N. An MLP of ``--layers`` square layers of ``--width`` trains on fixed random data; every hook
runs ``--rounds`` times in turn, with a fresh DDP model each time, and its timed steps are
pooled. A step is timed from a synchronised device to a synchronised device. Without a GPU it
runs on the CPU over gloo, with a model, batch and budget sized for a CPU (seconds, not
minutes), so the same command tries the script anywhere::

    python examples/gpu_step_time.py --bucket-cap-mb 25,4096 --json gpu.json
"""

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks as torch_debugging
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_local
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks

# Ours by their registered names, each beside PyTorch's counterpart where PyTorch has one.
HOOKS = [
    "no_hook",
    "noop",
    "torch_noop",
    "allreduce",
    "torch_allreduce",
    "fp16",
    "torch_fp16",
    "bf16",
    "torch_bf16",
    "int8",
    "int4",
    "power_sgd",
    "power_sgd_single_round",
    "torch_power_sgd",
    "batched_power_sgd",
    "torch_batched_power_sgd",
    "post_local_sgd",
    "torch_post_local_sgd",
]
START_STEP = 2  # PowerSGD compresses, and local SGD stops averaging gradients, from this step


def our_options(name: str, rank: int) -> dict[str, Any]:
    """Options for our hook ``name`` that start its real work within the warm-up."""
    if "power_sgd" in name:
        return {"matrix_approximation_rank": rank, "start_powerSGD_iter": START_STEP}
    if name == "post_local_sgd":
        return {"start_localSGD_iter": START_STEP}
    return {}


def _theirs(hook: Callable[..., Any], state: Callable[[], Any]) -> Callable[[DDP], None]:
    return lambda ddp: ddp.register_comm_hook(state(), hook)


def attach(name: str, rank: int) -> Callable[[DDP], None] | None:
    """What registers hook ``name`` on a DDP model (PowerSGD at ``rank``); None for no hook."""
    if name == "no_hook":
        return None
    if not name.startswith("torch_"):
        return lambda ddp: commhooks.register(ddp, name, **our_options(name, rank))

    def powersgd() -> Any:
        return torch_powersgd.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=START_STEP
        )

    table = {
        "torch_noop": _theirs(torch_debugging.noop_hook, lambda: None),
        "torch_allreduce": _theirs(torch_default.allreduce_hook, lambda: None),
        "torch_fp16": _theirs(torch_default.fp16_compress_hook, lambda: None),
        "torch_bf16": _theirs(torch_default.bf16_compress_hook, lambda: None),
        "torch_power_sgd": _theirs(torch_powersgd.powerSGD_hook, powersgd),
        "torch_batched_power_sgd": _theirs(torch_powersgd.batched_powerSGD_hook, powersgd),
        "torch_post_local_sgd": _theirs(
            torch_local.post_localSGD_hook,
            lambda: torch_local.PostLocalSGDState(None, None, start_localSGD_iter=START_STEP),
        ),
    }
    return table[name]


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device, start: bool) -> int:
    if device.type != "cuda":
        return 0
    if start:
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return torch.cuda.max_memory_allocated(device)


def run_hook(
    name: str, cap: float, args: argparse.Namespace, device: torch.device
) -> tuple[list[float], int]:
    """Step times (seconds) of one fresh DDP model with hook ``name``, and its peak memory."""
    model = build_model(args, device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=cap)
    register = attach(name, args.rank)
    if register is not None:
        register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(args.batch, args.width, generator=gen).to(device)
    y = torch.randn(args.batch, args.width, generator=gen).to(device)
    sync(device)
    base = peak_memory(device, start=True)
    times = []
    for step in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return times, peak_memory(device, start=False) - base


def progress(done: int, total: int, text: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{done}/{total}] {text}", flush=True)


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    results: dict[str, Any] = {}
    total, done = len(args.bucket_cap_mb) * args.rounds * len(args.hooks), 0
    for cap in args.bucket_cap_mb:
        pooled: dict[str, list[float]] = {name: [] for name in args.hooks}
        peaks: dict[str, int] = {}
        errors: dict[str, str] = {}
        for _ in range(args.rounds):
            for name in args.hooks:
                done += 1
                if name in errors:
                    continue
                try:
                    times, peak = run_hook(name, cap, args, device)
                except Exception as exc:  # PyTorch's batched hook fails; a row says so
                    errors[name] = f"{type(exc).__name__}: {exc}"[:200]
                    progress(done, total, f"cap {cap:g} MB {name}: failed")
                    continue
                # A step lasts as long as its slowest rank.
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, times)
                pooled[name] += [max(per_step) for per_step in zip(*everyone)]
                peaks[name] = max(peaks.get(name, 0), peak)
                ms = statistics.median(pooled[name]) * 1e3
                progress(done, total, f"cap {cap:g} MB {name}: {ms:.2f} ms/step so far")
        for name in args.hooks:
            if name in errors:
                results[f"{cap:g}/{name}"] = {"error": errors[name]}
                continue
            quartiles = statistics.quantiles(pooled[name], n=4)
            results[f"{cap:g}/{name}"] = {
                "median_ms": statistics.median(pooled[name]) * 1e3,
                "iqr_ms": (quartiles[2] - quartiles[0]) * 1e3,
                "peak_mib": peaks[name] / 2**20,
            }
    return results


def report(results: dict[str, Any]) -> None:
    for key, row in results.items():
        cap, name = key.split("/")
        if "error" in row:
            print(f"cap {cap:>5} MB  {name:24s} failed: {row['error']}")
            continue
        theirs = results.get(f"{cap}/torch_{name}", {})
        versus = (
            f"  {row['median_ms'] / theirs['median_ms']:.2f}x PyTorch's"
            if "median_ms" in theirs
            else ""
        )
        print(
            f"cap {cap:>5} MB  {name:24s} {row['median_ms']:8.3f} ms/step "
            f"(IQR {row['iqr_ms']:.3f})  peak +{row['peak_mib']:7.1f} MiB{versus}"
        )


# Sizes that take seconds per hook on the device found: a GPU's (256 MiB of gradients), or a
# CPU's, where the GPU's would run for many minutes.
DEFAULTS = {
    "cuda": {"width": 4096, "layers": 4, "batch": 512, "steps": 30, "warmup": 8, "rounds": 3},
    "cpu": {"width": 256, "layers": 2, "batch": 32, "steps": 10, "warmup": 3, "rounds": 1},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    found = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=found,
        help=f"default: {found}, what this machine has; the sizes below default to its own",
    )
    for name, kind, what in (
        ("--width", int, "the MLP's width"),
        ("--layers", int, "the MLP's square layers"),
        ("--batch", int, "the batch per rank"),
        ("--steps", int, "timed steps per run"),
        ("--warmup", int, "untimed steps before them"),
        ("--rounds", int, "runs of every hook in turn"),
    ):
        sizes = ", ".join(f"{d} {DEFAULTS[d][name[2:]]}" for d in DEFAULTS)
        parser.add_argument(name, type=kind, default=None, help=f"{what} (default: {sizes})")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's approximation rank")
    parser.add_argument("--bucket-cap-mb", default="25,4096", help="comma-separated DDP caps")
    parser.add_argument("--hooks", default=",".join(HOOKS), help=f"any of {', '.join(HOOKS)}")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.bucket_cap_mb = [float(c) for c in args.bucket_cap_mb.split(",")]
    args.hooks = [h.strip() for h in args.hooks.split(",")]
    unknown = sorted(set(args.hooks) - set(HOOKS))
    if unknown:
        parser.error(f"unknown hooks {unknown}; choose from {', '.join(HOOKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; pass --device cpu to run on gloo instead")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = measure(args, device)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        grads = args.layers * (args.width + 1) * args.width * 4 / 2**20
        print(
            f"torch {torch.__version__}, {world} x {name}, {backend}; MLP {args.layers} x "
            f"{args.width} ({grads:.0f} MiB of gradients), batch {args.batch}"
        )
        report(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"settings": vars(args), "world_size": world, "results": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
