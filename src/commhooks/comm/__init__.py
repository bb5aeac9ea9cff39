"""Every call into ``torch.distributed`` the package makes lives in this package.

Hooks and averagers say *what* to communicate; this package says *how* it is issued, the same
on every backend and device: the backend's own collectives (:mod:`.collectives`), the groups
they run on (:mod:`.groups`), follow-ups issued in the same order on every rank
(:mod:`.issuer`), and which ranks share a machine (:mod:`.machines`).
"""

from commhooks.comm.collectives import (
    CollectiveCounter,
    all_gather_into,
    all_to_all,
    allreduce,
    allreduce_then,
    average,
    chain,
    completed,
    completes_inline,
    completing_inline,
    fail,
    forward,
    future_devices,
    new_future,
    observe_collectives,
    reduce_scatter,
    size,
    then,
    used_on_current_stream,
)
from commhooks.comm.groups import (
    all_gather_objects,
    backend_for_device,
    check_same_on_grid,
    excludes_this_rank,
    follow_up_group,
    gather_objects,
    global_ranks,
    group_rank,
    group_timeout,
    is_default_group,
    new_groups,
    resolve_group,
    world_size,
)
from commhooks.comm.issuer import IssuerPool, OrderedIssuer, issuer_for
from commhooks.comm.topology import Topology, TwoHops, two_hops
from commhooks.comm.topology import find as topology_of

__all__ = [
    "CollectiveCounter",
    "IssuerPool",
    "OrderedIssuer",
    "Topology",
    "TwoHops",
    "all_gather_into",
    "all_gather_objects",
    "all_to_all",
    "allreduce",
    "allreduce_then",
    "average",
    "backend_for_device",
    "chain",
    "check_same_on_grid",
    "completed",
    "completes_inline",
    "completing_inline",
    "excludes_this_rank",
    "fail",
    "forward",
    "follow_up_group",
    "future_devices",
    "gather_objects",
    "global_ranks",
    "group_rank",
    "group_timeout",
    "is_default_group",
    "issuer_for",
    "new_future",
    "new_groups",
    "observe_collectives",
    "reduce_scatter",
    "resolve_group",
    "size",
    "then",
    "topology_of",
    "two_hops",
    "used_on_current_stream",
    "world_size",
]
