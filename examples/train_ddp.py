"""Train a small model with DDP on CPU using a commhooks hook.

One machine, two processes:
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook fp16
Several machines (run on each, with its own --node_rank):
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 \
        --rdzv_backend c10d --rdzv_endpoint HOST:29500 examples/train_ddp.py
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks

HOOKS = {
    "allreduce": commhooks.allreduce_hook,
    "fp16": commhooks.fp16_compress_hook,
    "bf16": commhooks.bf16_compress_hook,
    "noop": commhooks.noop_hook,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=sorted(HOOKS), default="fp16")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)))
    model.register_comm_hook(None, HOOKS[args.hook])
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
            print(f"step {step:3d}  loss {loss.item():.4f}  hook {args.hook}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
