"""Run one hook on fresh rank processes, on loopback or inside a private network.

Each hook gets new processes (:func:`commhooks.testing.run_on_ranks`): state, memory and a
crash are its own. With a private network each rank moves itself into its namespace before it
touches the network, and binds gloo to its link; the ranks rendezvous through a file store, so
the only traffic on the benchmark link is the hooks' own. A rank that fails makes the others
be killed, and the failure comes back as an outcome with ``ok=False`` and the error, never as
an exception.
"""

import functools
from collections.abc import Callable

from commhooks.bench.netns import Network, enter_namespace
from commhooks.bench.records import RunOutcome, RunSpec
from commhooks.testing import RankError, run_on_ranks, start_fork_server

__all__ = ["run_hook", "start_fork_server"]

_PG_TIMEOUT_S = 120.0
_LOG_CHARS = 3000


def run_hook(
    spec: RunSpec, world_size: int, network: Network | None = None, timeout: float = 600.0
) -> RunOutcome:
    """Run ``spec`` on ``world_size`` ranks, inside ``network`` when given.

    ``network`` must be open; ``spec.host_ends`` should name its links, so that the ranks read
    their counters.
    """
    from commhooks.bench.worker import train_rank  # imports torch: not before a run

    env = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    prepare: Callable[[int], None] | None = None
    if network is not None:
        env.update(network.env())
        prepare = functools.partial(enter_namespace, network.namespaces)
    try:
        ranks = run_on_ranks(
            train_rank,
            world_size,
            spec,
            timeout=timeout,
            pg_timeout=_PG_TIMEOUT_S,
            env=env,
            prepare=prepare,
        )
    except RankError as exc:
        return RunOutcome(ok=False, error=exc.summary, log=str(exc)[-_LOG_CHARS:])
    return RunOutcome(ok=True, ranks=ranks)
