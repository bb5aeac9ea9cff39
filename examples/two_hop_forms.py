"""Two hops against the flat path on 2 machines of 2 ranks: what crosses the machines' link.

The quantized hooks take two hops by default on such a cluster (``commhooks.Topology``): sum
within the machine, only the machine's share across, gather within. This script measures them
against their flat form (``topology="flat"``), the same two-hop form written here for the hooks
that do not take it (allreduce, fp16, PowerSGD) against theirs, and streaming DiLoCo with each
machine a worker of two ranks; on 4 gloo ranks as 2 machines of 2 (``--bandwidth``: two network
namespaces joined by a rate-limited link, bytes read from the link's counters; root), a model of
1.05M float32 parameters, ``bucket_cap_mb=1``, batch 16 a rank. The prototypes:

* ``allreduce`` and ``fp16``: reduce-scatter within the machine (float32), the share averaged
  across machines by the hook itself (fp16: cast, divide, sum, cast back), all-gather within;
* ``power_sgd``: allreduce within the machine (float32), each rank of a machine compresses every
  G-th matrix of the machine's mean with PowerSGD across machines, allreduce within to put the
  bucket together (a reduce-scatter by whole matrices, written simply).

It prints, per hook and form, the step time, the bytes a machine sent over its link per step,
and the held-out loss::

    sudo python examples/two_hop_forms.py --bandwidth 100mbit
    python examples/two_hop_forms.py --steps 8

Without ``--bandwidth`` the ranks talk over loopback: step times only, no bytes counted.
"""

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import comm
from commhooks.testing import run_on_ranks

HOOKS = ("allreduce", "fp16", "power_sgd", "int8", "int4")
WIDTHS = (256, 512, 512, 512, 512, 256)  # 1.05M float32 parameters in 5 layers


class Share:
    """A bucket-like view of some of a bucket's gradients, for PowerSGD across machines."""

    def __init__(
        self, index: int, grads: list[torch.Tensor], params: list[Any], last: bool = False
    ) -> None:
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        self._shapes = [g.shape for g in grads]

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in self._shapes:
            out.append(self._buffer[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        return out

    def parameters(self) -> list[Any]:
        return self._params

    def is_last(self) -> bool:
        return self._last  # PowerSGD counts its steps at the last bucket


class TwoHopState:
    """The groups of the two hops, and PowerSGD's state across machines."""

    def __init__(self, name: str) -> None:
        topology = comm.topology_of(dist.group.WORLD)
        self.hops = comm.two_hops(dist.group.WORLD, topology)
        self.name = name
        self.power = commhooks.PowerSGDState(
            self.hops.peers, matrix_approximation_rank=1, start_powerSGD_iter=2
        )


def _share_average(state: TwoHopState, share: torch.Tensor) -> torch.Tensor:
    """The hook's compression across machines, on the machine's mean of this rank's share."""
    peers, nnodes = state.hops.peers, state.hops.nnodes
    if state.name == "fp16":
        half = share.to(torch.float16).div_(nnodes)
        comm.allreduce(half, peers).wait()
        return half.to(share.dtype)
    comm.allreduce(share, peers).wait()
    return share.div_(nnodes)


def two_hop_hook(state: TwoHopState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum within, the share across, gather within (blocking: a measurement, not a design)."""
    buffer, g = bucket.buffer(), state.hops.nproc_per_node
    if state.name == "power_sgd":
        return _power_two_hops(state, bucket)
    size = -(-buffer.numel() // g)
    whole = buffer.new_zeros(size * g)
    whole[: buffer.numel()].copy_(buffer)
    share = comm.reduce_scatter(buffer.new_empty(size), whole, state.hops.intra).wait().div_(g)
    averaged = _share_average(state, share)
    comm.all_gather_into(whole.view(g, -1), averaged, state.hops.intra).wait()
    return comm.completed(whole[: buffer.numel()].view_as(buffer).clone())


def _power_two_hops(
    state: TwoHopState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer, g, local = bucket.buffer(), state.hops.nproc_per_node, state.hops.local
    comm.allreduce(buffer, state.hops.intra).wait()
    buffer.div_(g)
    grads, params = bucket.gradients(), bucket.parameters()
    mine = [i for i in range(len(grads)) if i % g == local]
    share = Share(
        bucket.index(), [grads[i] for i in mine], [params[i] for i in mine], bucket.is_last()
    )
    averaged = commhooks.powerSGD_hook(state.power, share).wait()  # type: ignore[arg-type]
    out = torch.zeros_like(buffer)
    views = Share(0, [torch.zeros_like(gr) for gr in grads], params)
    views.set_buffer(out)
    placed = views.gradients()
    offset = 0
    for i in mine:
        n = grads[i].numel()
        placed[i].copy_(averaged[offset : offset + n].view_as(grads[i]))
        offset += n
    comm.allreduce(out, state.hops.intra).wait()
    return comm.completed(out)


def _data(seed: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A teacher network's outputs on random inputs: the same teacher on every rank."""
    torch.manual_seed(1234)
    teacher = nn.Sequential(nn.Linear(WIDTHS[0], 64), nn.Tanh(), nn.Linear(64, WIDTHS[-1]))
    gen = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(batches):
            x = torch.randn(16, WIDTHS[0], generator=gen)
            out.append((x, teacher(x)))
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _attach(ddp: DDP, name: str, form: str) -> None:
    if name in ("int8", "int4"):  # the package's own choice: two hops unless told flat
        commhooks.register(ddp, name, topology="flat" if form == "flat" else "auto")
    elif form == "flat":
        options = {"start_powerSGD_iter": 2} if name == "power_sgd" else {}
        commhooks.register(ddp, name, **options)
    else:
        ddp.register_comm_hook(TwoHopState(name), two_hop_hook)


def _counters(host_end: str | None) -> int:
    """Bytes this machine's link has sent so far, or 0 without a link."""
    if host_end is None:
        return 0
    from commhooks.bench import netns

    found = netns.link_counters(host_end)
    return 0 if found is None else int(found.get("tx_bytes", 0))


def _train(
    ddp: DDP, opt: torch.optim.Optimizer, data: list[Any], host_end: str | None
) -> tuple[list[float], list[int]]:
    """Each step's time and the bytes this machine's link sent during it."""
    times, sent = [], []
    for x, y in data:
        dist.barrier()
        before, start = _counters(host_end), time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
        sent.append(_counters(host_end) - before)
    return times, sent


def _row(ddp: DDP, times: list[float], sent: list[int], held_out: list[Any]) -> dict[str, Any]:
    with torch.no_grad():
        loss = sum(float(nn.functional.mse_loss(ddp.module(x), y)) for x, y in held_out)
    later = sorted(times[3:])
    return {
        "ms": 1000 * later[len(later) // 2],
        "bytes_per_step": sorted(sent[3:])[len(later) // 2],
        "held_out": loss / len(held_out),
    }


def _diloco(rank: int, data: list[Any], host_end: str | None) -> dict[str, Any]:
    """Streaming DiLoCo, each machine a worker of 2 ranks (DDP inside it): the mean bytes a
    machine sends a step over 8 steps, one whole round of its 4 fragments, read from the
    counters before and after the 8 steps (a fragment travels between the steps too)."""
    workers = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ddp = DDP(_model(), bucket_cap_mb=1, process_group=workers[rank // 2])
    diloco = commhooks.register(
        ddp, "streaming_diloco", sync_every=8, fragments=4, fragment_sync_delay=1, bits=4
    )
    inner = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    diloco.attach(inner, ddp.module.named_parameters())
    _train(ddp, inner, data[:8], host_end)
    dist.barrier()
    before = _counters(host_end)
    times, _ = _train(ddp, inner, data[8:16], host_end)
    dist.barrier()
    return {"bytes_per_step": (_counters(host_end) - before) // 8, "ms": 1000 * sorted(times)[4]}


def run_rank(
    rank: int, world_size: int, steps: int, host_end: str | None, hooks: tuple[str, ...] = HOOKS
) -> dict[str, Any]:
    """Each hook in both forms: step time (median), link bytes a step, held-out loss."""
    out: dict[str, Any] = {}
    train, held_out = _data(rank, steps), _data(10_000, 4)
    for name in hooks:
        for form in ("flat", "two hops"):
            ddp = DDP(_model(), bucket_cap_mb=1)
            _attach(ddp, name, form)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
            out[f"{name}, {form}"] = _row(ddp, *_train(ddp, opt, train, host_end), held_out)
    out["streaming_diloco, 2 workers of 2"] = _diloco(rank, _data(rank, 16), host_end)
    return out


def _machine(namespaces: list[str] | None, rank: int) -> None:
    """Rank ``rank`` on machine ``rank // 2``: in that machine's namespace where there is one."""
    os.environ[comm.topology.MACHINE_ID_VAR] = f"machine{rank // 2}"
    if namespaces is not None:
        from commhooks.bench import netns

        netns.enter_namespace(namespaces, rank)


def measure(steps: int, bandwidth: str | None, hooks: tuple[str, ...] = HOOKS) -> dict[str, Any]:
    """Rank 0's rows (machine 0's link), on loopback or on 2 namespaces joined at ``bandwidth``."""
    if bandwidth is None:
        prepare = functools.partial(_machine, None)
        return run_on_ranks(run_rank, 4, steps, None, hooks, prepare=prepare, timeout=600)[0]
    from commhooks.bench import netns
    from commhooks.bench.units import parse_rate

    with netns.Network(2, parse_rate(bandwidth), per_node=2) as net:
        prepare = functools.partial(_machine, net.rank_namespaces())
        ends = net.rank_host_ends()
        results = run_on_ranks(
            run_rank_on, 4, steps, ends, hooks, prepare=prepare, env=net.env(), timeout=600
        )
    return results[0]


def run_rank_on(
    rank: int, world_size: int, steps: int, ends: list[str], hooks: tuple[str, ...]
) -> dict[str, Any]:
    return run_rank(rank, world_size, steps, ends[rank], hooks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--bandwidth", help="the link between the machines, e.g. 100mbit (root)")
    parser.add_argument(
        "--hooks", default=",".join(HOOKS), help=f"some of {','.join(HOOKS)} (default: all)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    hooks = tuple(h for h in args.hooks.split(",") if h)
    unknown = sorted(set(hooks) - set(HOOKS))
    if unknown:
        parser.error(f"--hooks: unknown {unknown}; choose from {','.join(HOOKS)}")
    rows = measure(args.steps, args.bandwidth, hooks)
    print(f"{'hook, form':<33} {'ms/step':>8} {'link bytes/step':>16} {'held-out':>9}")
    for label, row in rows.items():
        loss = f"{row['held_out']:9.4f}" if "held_out" in row else f"{'-':>9}"
        print(f"{label:<33} {row['ms']:8.1f} {row['bytes_per_step']:16,d} {loss}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
