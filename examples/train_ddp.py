"""Train a small model with DDP, with any commhooks hook chosen on the command line.

Each process uses NCCL on its GPU (cuda:LOCAL_RANK) where there are GPUs, and gloo on the CPU
otherwise, as `commhooks bench` does. One machine, two processes:
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook fp16
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook allreduce --wrapper bf16
Several machines (run on each, with its own --node_rank):
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 \
        --rdzv_backend c10d --rdzv_endpoint HOST:29500 examples/train_ddp.py --hook fp16
Hook options go as JSON, e.g. --options '{"matrix_approximation_rank": 2}'.

PowerSGD keeps PyTorch's default start_powerSGD_iter=1000: it allreduces plainly, compressing
nothing, for the first 1000 steps; --options '{"start_powerSGD_iter": 10}' starts sooner.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.config import hook_names, hook_spec, wrapper_names

# Options a hook requires, given here so that every --hook runs as it is: post-local SGD
# switches from global to local averaging at this step.
EXAMPLE_DEFAULTS = {"start_localSGD_iter": 10}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hook",
        choices=hook_names(),
        default="fp16",
        help="the hook (default fp16). power_sgd keeps PyTorch's default "
        "start_powerSGD_iter=1000 and so compresses nothing for the first 1000 steps: pass "
        "--options '{\"start_powerSGD_iter\": 10}' to compress from step 10. post_local_sgd "
        "switches to local averaging at step 10 unless --options says otherwise",
    )
    parser.add_argument("--wrapper", choices=wrapper_names(), default="no")
    parser.add_argument(
        "--options",
        type=json.loads,
        default={},
        help="hook options as JSON, e.g. '{\"matrix_approximation_rank\": 2}'",
    )
    parser.add_argument("--steps", type=int, default=50)
    return parser


def hook_options(hook: str, given: dict) -> dict:
    """``given``, with this example's value for each option ``hook`` requires and lacks."""
    required = hook_spec(hook).required
    return {**{k: v for k, v in EXAMPLE_DEFAULTS.items() if k in required}, **given}


def backend_and_device() -> tuple[str, torch.device]:
    """NCCL on this process's GPU where there are GPUs, gloo on the CPU otherwise."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return "nccl", device
    return "gloo", torch.device("cpu")


def train(args: argparse.Namespace, rank: int, device: torch.device) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    state = commhooks.register(
        model, args.hook, args.wrapper, **hook_options(args.hook, args.options)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    gen = torch.Generator().manual_seed(rank)
    true_w = torch.randn(64, 1, generator=torch.Generator().manual_seed(42)).to(device)
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=gen).to(device)
        loss = nn.functional.mse_loss(model(x), x @ true_w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}  hook {args.hook}/{args.wrapper}")
    if rank == 0:
        print(f"state {type(state).__name__}, {dist.get_backend()} on {device.type}")


def main() -> None:
    args = build_parser().parse_args()
    backend, device = backend_and_device()
    dist.init_process_group(backend)
    train(args, dist.get_rank(), device)
    # The model, its hook and their futures are gone once train() returns. Only then tear the
    # groups down, with both ranks done: gloo threads that still held Python objects at
    # interpreter exit would abort the process.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
