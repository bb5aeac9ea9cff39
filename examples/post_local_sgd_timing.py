"""Step time of post-local SGD against plain allreduce and the no-communication floor.

Runs 2 local gloo ranks (loopback) on a small MLP and prints the mean step time of:
``allreduce`` (DDP without a hook), ``noop`` (no gradient communication at all) and
``post_local`` (post-local SGD after a 5-step warm-up, no local gradient allreduce, parameters
averaged every ``--period`` steps). A step's time is the slower rank's; the modes run in
alternation for ``--rounds`` rounds and the best round is kept, to damp other load::

    python examples/post_local_sgd_timing.py --steps 40 --period 4 --rounds 3
"""

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.testing import run_on_ranks

WIDTHS = (512, 1024, 1024, 1024, 512)
WARMUP = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _time(rank: int, world_size: int, mode: str, steps: int, period: int) -> list[float]:
    model = _model()
    ddp = DDP(model)
    opt: torch.optim.Optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    if mode == "noop":
        ddp.register_comm_hook(None, commhooks.noop_hook)
    elif mode == "post_local":
        state = commhooks.PostLocalSGDState(None, None, WARMUP, post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, commhooks.post_localSGD_hook)
        opt = commhooks.PostLocalSGDOptimizer(
            opt, commhooks.PeriodicModelAverager(period, warmup_steps=WARMUP)
        )
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(32, WIDTHS[0], generator=gen)
    y = torch.randn(32, WIDTHS[-1], generator=gen)
    times = []
    for _ in range(WARMUP + steps):
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    params = sum(p.numel() for p in _model().parameters())
    print(f"model: {params / 1e6:.2f} M parameters, 2 gloo ranks on loopback")
    modes = ("allreduce", "noop", "post_local")
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(args.rounds):
        for mode in modes:
            per_rank = run_on_ranks(_time, 2, mode, args.steps, args.period, timeout=600)
            mean = statistics.fmean(max(ts) for ts in zip(*per_rank))
            best[mode] = min(best[mode], mean)
    for mode in modes:
        print(f"{mode:>10}: mean step {best[mode] * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
