"""Train a small model with DDP on CPU, with any commhooks hook chosen on the command line.

One machine, two processes:
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook fp16
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook allreduce --wrapper bf16
Several machines (run on each, with its own --node_rank):
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 \
        --rdzv_backend c10d --rdzv_endpoint HOST:29500 examples/train_ddp.py --hook fp16
Hook options go as JSON, e.g. --options '{"matrix_approximation_rank": 2}'.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.config import hook_names, wrapper_names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=hook_names(), default="fp16")
    parser.add_argument("--wrapper", choices=wrapper_names(), default="no")
    parser.add_argument("--options", type=json.loads, default={}, help="hook options as JSON")
    parser.add_argument("--steps", type=int, default=50)
    return parser


def train(args: argparse.Namespace, rank: int) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)))
    state = commhooks.register(model, args.hook, args.wrapper, **args.options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    gen = torch.Generator().manual_seed(rank)
    true_w = torch.randn(64, 1, generator=torch.Generator().manual_seed(42))
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        loss = nn.functional.mse_loss(model(x), x @ true_w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}  hook {args.hook}/{args.wrapper}")
    if rank == 0:
        print(f"state {type(state).__name__}")


def main() -> None:
    args = build_parser().parse_args()
    dist.init_process_group("gloo")
    train(args, dist.get_rank())
    # The model, its hook and their futures are gone once train() returns. Only then tear the
    # groups down, with both ranks done: gloo threads that still held Python objects at
    # interpreter exit would abort the process.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
