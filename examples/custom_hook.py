"""A communication hook of your own, checked against commhooks' allreduce on local ranks.

    python examples/custom_hook.py

The hook averages a bucket as DDP does without a hook: divide by the world size, then sum
across ranks. Each rank trains the same model twice, once with this hook and once with
``commhooks.allreduce_hook``, and the parameters must agree.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.testing import run_on_ranks


# --8<-- [start:hook]
def scaled_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket: divide it by the world size, then sum it across ranks."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# --8<-- [end:hook]


def train(rank: int, hook: object) -> list[torch.Tensor]:
    """Three steps of a small model on this rank's own data; the parameters after them."""
    torch.manual_seed(0)  # the same initial model on every rank
    model = DDP(torch.nn.Linear(16, 4))
    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(rank))
    for x in data:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


# --8<-- [start:compare]
def compare(rank: int, world_size: int) -> bool:
    """Whether this rank's model trained with the custom hook equals the reference's."""
    mine = train(rank, scaled_allreduce_hook)
    reference = train(rank, commhooks.allreduce_hook)
    return all(torch.allclose(a, b) for a, b in zip(mine, reference))


# --8<-- [end:compare]


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    agree = run_on_ranks(compare, 2)
    print("the custom hook agrees with allreduce_hook on every rank" if all(agree) else agree)
    return 0 if all(agree) else 1


if __name__ == "__main__":
    raise SystemExit(main())
