"""Run one hook on fresh rank processes, on loopback or inside a private network.

Each hook gets new processes (:func:`commhooks.testing.run_on_ranks`): state, memory and a
crash are its own. The ranks are machines of the run's shape: each is told its machine as a
launcher would tell it (:func:`commhooks.bench.shape.place_rank`), so that the hooks group
ranks by machine on loopback as on the links. With a private network each rank moves itself
into its machine's namespace before it touches the network, and binds gloo to the machine's
link; the ranks rendezvous through a file store, so the only traffic on the benchmark link is
the hooks' own. A rank that fails makes the others be killed, and the failure comes back as
an outcome with ``ok=False`` and the error, never as an exception.
"""

import functools

from commhooks.bench.netns import Network, enter_namespace
from commhooks.bench.records import RunOutcome, RunSpec
from commhooks.bench.shape import Shape, place_rank
from commhooks.testing import RankError, run_on_ranks, start_fork_server

__all__ = ["run_hook", "start_fork_server"]

_PG_TIMEOUT_S = 120.0
_LOG_CHARS = 3000


def run_hook(
    spec: RunSpec, shape: Shape, network: Network | None = None, timeout: float = 600.0
) -> RunOutcome:
    """Run ``spec`` on the ranks of ``shape``, inside ``network`` when given.

    ``network`` must be open, with ``shape``'s machines; ``spec.host_ends`` should name its
    links, so that the ranks read their machine's counters.
    """
    from commhooks.bench.worker import train_rank  # imports torch: not before a run

    env = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    names = [f"bench-machine-{m}" for m in range(shape.nodes)]
    namespaces: list[str] | None = None
    if network is not None:
        env.update(network.env())
        names, namespaces = network.namespaces, network.rank_namespaces()
    try:
        ranks = run_on_ranks(
            train_rank,
            shape.ranks,
            spec,
            timeout=timeout,
            pg_timeout=_PG_TIMEOUT_S,
            env=env,
            prepare=functools.partial(_enter_machine, shape, names, namespaces),
        )
    except RankError as exc:
        return RunOutcome(ok=False, error=exc.summary, log=str(exc)[-_LOG_CHARS:])
    return RunOutcome(ok=True, ranks=ranks)


def _enter_machine(shape: Shape, names: list[str], namespaces: list[str] | None, rank: int) -> None:
    """In rank ``rank``'s fresh process: its machine's variables, then its namespace if any."""
    place_rank(shape, names, rank)
    if namespaces is not None:
        enter_namespace(namespaces, rank)
