"""Train a model sharded with FSDP2 within each machine, its gradients averaged across machines
by a commhooks hook (HSDP with the slow link compressed).

Two machines with N GPUs each (run on each, with its own --node_rank):
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node N --rdzv_backend c10d \\
        --rdzv_endpoint HOST:29500 examples/train_fsdp.py --hook power_sgd
On a laptop (CPU, gloo), 4 processes standing for 2 machines x 2 ranks:
    torchrun --nproc_per_node 4 examples/train_fsdp.py --ranks-per-machine 2 --hook power_sgd
Hook options go as JSON, e.g. --options '{"matrix_approximation_rank": 4}'. With --checkpoint
DIR the run resumes from DIR if it holds a checkpoint, and saves there at the end.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import commhooks
from commhooks.integrations.checkpoint import DistributedCheckpointState


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=commhooks.fsdp.hook_names(), default="power_sgd")
    parser.add_argument("--options", type=json.loads, default={}, help="hook options as JSON")
    parser.add_argument(
        "--ranks-per-machine",
        type=int,
        default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        help="ranks that shard the model together (default: torchrun's --nproc_per_node)",
    )
    parser.add_argument("--reduce-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--checkpoint", help="directory to resume from and save to (dcp)")
    return parser


def build(args: argparse.Namespace, device: str) -> tuple[nn.Module, object]:
    """The model sharded over each machine's ranks, with the hook across machines."""
    world = dist.get_world_size()
    machines = world // args.ranks_per_machine
    mesh = init_device_mesh(
        device, (machines, args.ranks_per_machine), mesh_dim_names=("replicate", "shard")
    )
    torch.manual_seed(0)
    model = nn.Sequential(*(block(256 if i else 64) for i in range(4)), nn.Linear(256, 1))
    model.to(device)
    policy = MixedPrecisionPolicy(reduce_dtype=getattr(torch, args.reduce_dtype))
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"], mp_policy=policy)
    fully_shard(model, mesh=mesh["shard"], mp_policy=policy)
    state = commhooks.fsdp.register(model, args.hook, mesh=mesh, **args.options)
    if dist.get_rank() == 0:
        print(f"mesh {machines} machines x {args.ranks_per_machine} ranks, hook {args.hook}")
    return model, state


def block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 256), nn.ReLU())


def checkpoint(model: nn.Module, opt: torch.optim.Optimizer, state: object) -> dict[str, object]:
    """What to save: the model's and optimizer's shards and, for a stateful hook, each rank's
    own hook state (PowerSGD's error memory differs between ranks) under a key of its own."""
    model_state, opt_state = get_state_dict(model, opt)
    out: dict[str, object] = {"model": model_state, "opt": opt_state}
    if hasattr(state, "state_dict"):
        out["hook"] = DistributedCheckpointState(state)
    return out


def train(args: argparse.Namespace, rank: int, device: str) -> None:
    model, state = build(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, ".metadata")):
        saved = checkpoint(model, opt, state)
        dcp.load(saved, checkpoint_id=args.checkpoint)
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["opt"])
        start = getattr(state, "iter", 0)
        if rank == 0:
            print(f"resumed at step {start}")

    true_w = torch.randn(64, 1, generator=torch.Generator().manual_seed(42)) / 8
    for step in range(start, start + args.steps):
        # Each step's batch depends on the step only, so a resumed run sees what it would have.
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step * 1000 + rank))
        loss = nn.functional.mse_loss(model(x.to(device)), (x @ true_w).to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == start + args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}")
    if args.checkpoint:
        dcp.save(checkpoint(model, opt, state), checkpoint_id=args.checkpoint)
        if rank == 0:
            print(f"saved to {args.checkpoint}")


def main() -> None:
    args = build_parser().parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device, backend = "cuda", "nccl"
    else:
        device, backend = "cpu", "gloo"
    dist.init_process_group(backend)
    if dist.get_world_size() % args.ranks_per_machine:
        raise SystemExit(
            f"--ranks-per-machine {args.ranks_per_machine} does not divide the "
            f"{dist.get_world_size()} ranks."
        )
    train(args, dist.get_rank(), device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
