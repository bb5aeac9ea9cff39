"""How long gloo's all-to-all and all-gather take between two ranks, whole or in pieces.

Gloo's sends are rendezvous: a rank sends once its peer's notice that it is ready to receive
has arrived, and that notice travels behind whatever the peer is already sending. Between two
ranks the late one sends its whole payload before its notice, and the link's two directions
take turns. Split into ``k`` collectives issued at once, only the first piece waits so: this
is why :mod:`commhooks.comm` issues a large exchange on gloo in
:data:`commhooks.comm.EXCHANGE_PIECES` pieces. For each size a rank sends and each ``k``, the
median of ``--repeat`` runs after a barrier, as a multiple of one direction's bytes' time at
``--bandwidth`` (two network namespaces joined by a rate-limited link; root)::

    sudo python examples/exchange_pieces.py --bandwidth 100mbit --mb 1,3,6
    python examples/exchange_pieces.py --mb 1 --repeat 2

Without ``--bandwidth`` the ranks talk over loopback: milliseconds only.
"""

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from commhooks.bench import netns
from commhooks.bench.units import parse_rate
from commhooks.testing import run_on_ranks

PIECES = (1, 2, 4, 8)


def _all_to_all(nbytes: int, pieces: int) -> Callable[[], None]:
    rows = torch.ones(2, nbytes // 2, dtype=torch.uint8)
    sent = [part.contiguous() for part in rows.tensor_split(pieces, dim=1)]
    got = [torch.empty_like(part) for part in sent]
    return lambda: _wait([dist.all_to_all_single(o, i, async_op=True) for o, i in zip(got, sent)])


def _all_gather(nbytes: int, pieces: int) -> Callable[[], None]:
    sent = list(torch.ones(nbytes // 2, dtype=torch.uint8).tensor_split(pieces))
    got = [torch.empty(2 * part.numel(), dtype=torch.uint8) for part in sent]
    return lambda: _wait(
        [dist.all_gather_into_tensor(o, i, async_op=True) for o, i in zip(got, sent)]
    )


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def run_rank(rank: int, world_size: int, sizes: list[int], repeat: int) -> dict[str, float]:
    """Seconds per exchange, by ``"size kind pieces"``; ``size`` is what a rank hands over, of
    which half crosses to the other rank."""
    out = {}
    for nbytes in sizes:
        for kind, make in (("all-to-all", _all_to_all), ("all-gather", _all_gather)):
            for pieces in PIECES:
                exchange = make(nbytes, pieces)
                exchange()  # connections made, buffers touched
                times = []
                for _ in range(repeat):
                    dist.barrier()
                    start = time.perf_counter()
                    exchange()
                    times.append(time.perf_counter() - start)
                out[f"{nbytes} {kind} {pieces}"] = statistics.median(times)
    return out


def _enter(namespaces: list[str], rank: int) -> None:
    netns.enter_namespace(namespaces, rank)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", default="1,3,6", help="megabytes a rank hands over, e.g. 1,3,6")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--bandwidth", help="the link between the two ranks, e.g. 100mbit (root)")
    args = parser.parse_args(argv)
    sizes = [int(float(mb) * 1e6) for mb in args.mb.split(",")]
    if args.bandwidth is None:
        rate = None
        found = run_on_ranks(run_rank, 2, sizes, args.repeat, timeout=600)[0]
    else:
        rate = parse_rate(args.bandwidth)
        with netns.Network(2, rate) as net:
            enter = functools.partial(_enter, net.rank_namespaces())
            found = run_on_ranks(
                run_rank, 2, sizes, args.repeat, prepare=enter, env=net.env(), timeout=600
            )[0]
    print(f"{'a rank hands':>12} {'exchange':<11}" + "".join(f"{f'k={k}':>10}" for k in PIECES))
    for nbytes in sizes:
        for kind in ("all-to-all", "all-gather"):
            cells = [found[f"{nbytes} {kind} {k}"] for k in PIECES]
            one_way = 8 * nbytes / 2 / rate if rate else None
            shown = [f"{s / one_way:9.2f}x" if one_way else f"{s * 1e3:8.1f}ms" for s in cells]
            print(f"{nbytes:>12,} {kind:<11}" + " ".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
