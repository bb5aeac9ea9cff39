"""Which ranks share a machine: :class:`Topology`, found from the launch environment or given.

What crosses machines is what costs: knowing which ranks share one, a hook sums inside a machine
first and sends only the machine's share across (:class:`TwoHops`, the groups that takes).
PyTorch's ``new_subgroups()`` counts CUDA devices, so refuses CPU-only machines; we ask the
launcher: each rank's :class:`LaunchInfo` is gathered once (:func:`find`).

How a rank's machine is named, first match wins:

1. ``COMMHOOKS_MACHINE_ID``: an explicit label; ranks with equal labels share a machine, and
   ``LOCAL_WORLD_SIZE`` is then ignored. Use it when host names are not unique (containers
   with identical host names) or to simulate several machines on one host.
2. the host name (``socket.gethostname()``), split further by ``LOCAL_WORLD_SIZE`` when a host
   runs several launcher groups (torchrun gives each node a contiguous block of ranks, so a
   host's ranks are cut into consecutive blocks of that size).
"""

import operator
import os
import socket
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from commhooks.comm.groups import (
    all_gather_objects,
    follow_up_group,
    global_ranks,
    group_rank,
    subgroup,
)

__all__ = [
    "MACHINE_ID_VAR",
    "LaunchInfo",
    "Topology",
    "TwoHops",
    "find",
    "local_launch_info",
    "machine_rank_lists",
    "two_hops",
]

MACHINE_ID_VAR = "COMMHOOKS_MACHINE_ID"


@dataclass(frozen=True)
class LaunchInfo:
    """What one rank knows about where it runs: its host name, ``COMMHOOKS_MACHINE_ID`` and
    torchrun's ``LOCAL_WORLD_SIZE`` (``None`` where not set or invalid)."""

    host: str
    label: str | None
    local_world_size: int | None


def local_launch_info() -> LaunchInfo:
    """This process's :class:`LaunchInfo`, read from its environment."""
    label = os.environ.get(MACHINE_ID_VAR, "").strip() or None
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    size = int(raw) if raw.isdigit() and int(raw) > 0 else None
    return LaunchInfo(socket.gethostname(), label, size)


def machine_rank_lists(infos: list[LaunchInfo]) -> tuple[list[list[int]], str]:
    """Ranks (indices into ``infos``) by machine, ordered by their lowest rank (groups are made
    in the same order everywhere), and a sentence saying how they were found."""
    labels = [info.label for info in infos]
    if infos and all(labels):
        lists = list(_by_key(labels).values())
        source = f"{MACHINE_ID_VAR} labels"
    else:
        hosts = _by_key([info.host for info in infos])
        lists = [block for ranks in hosts.values() for block in _split_host(infos, ranks)]
        source = "host names split by LOCAL_WORLD_SIZE" if len(lists) > len(hosts) else "host names"
        if any(labels):
            # Half-labelled runs would group ranks by two rules at once; the host is the safe one.
            source += f" ({MACHINE_ID_VAR} is set on some ranks only, so it was ignored)"
    lists.sort(key=lambda ranks: ranks[0])
    return lists, f"{source}: {len(lists)} machine(s) of sizes {[len(r) for r in lists]}"


def _by_key(keys: list[str | None]) -> dict[str | None, list[int]]:
    out: dict[str | None, list[int]] = {}
    for rank, key in enumerate(keys):
        out.setdefault(key, []).append(rank)
    return out


def _split_host(infos: list[LaunchInfo], ranks: list[int]) -> list[list[int]]:
    sizes = {infos[r].local_world_size for r in ranks}
    size = sizes.pop() if len(sizes) == 1 else None
    # Split only when every rank on the host agrees and the blocks tile the host exactly;
    # anything else (mp.spawn without the variable, mixed launchers) is one machine.
    if size is None or size >= len(ranks) or len(ranks) % size:
        return [ranks]
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


@dataclass(frozen=True)
class Topology:
    """Which ranks share a machine: ``machines``, each the global ranks of one machine, kept in
    order (each machine's ranks ascending, the machines by their lowest rank), as the process
    groups made from them order their ranks, whatever order they were given in.

    Build it from the rank lists (``Topology([[0, 1], [2, 3]])``), from a 2-D ``DeviceMesh``
    whose first dimension runs across machines and second within one
    (:meth:`from_mesh`), or let a hook find it from the launcher (:func:`find`).
    """

    machines: tuple[tuple[int, ...], ...]

    def __init__(self, machines: Sequence[Sequence[int]]) -> None:
        lists = _rank_lists(machines)
        ranks = [r for m in lists for r in m]
        if not lists or not all(lists) or len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(
                "Topology takes one list of global ranks per machine, each rank once, e.g. "
                f"Topology([[0, 1], [2, 3]]); got {machines!r}."
            )
        object.__setattr__(self, "machines", lists)

    @classmethod
    def of(cls, value: Any) -> "Topology | None":
        """``value`` as a topology where it names one: a :class:`Topology`, a 2-D
        ``DeviceMesh`` (:meth:`from_mesh`), or rank lists as JSON and YAML hold them
        (``[[0, 1], [2, 3]]``); ``None`` for anything else."""
        if isinstance(value, Topology):
            return value
        if getattr(getattr(value, "mesh", None), "dim", None) is not None:
            return cls.from_mesh(value)
        if isinstance(value, list | tuple) and all(isinstance(m, list | tuple) for m in value):
            return cls(value)
        return None

    def as_lists(self) -> list[list[int]]:
        """The machines' rank lists, as JSON and YAML hold them (``Topology.of`` reads them)."""
        return [list(machine) for machine in self.machines]

    @classmethod
    def from_mesh(cls, mesh: Any) -> "Topology":
        """The topology of a 2-D ``DeviceMesh`` of shape ``(machines, ranks within one)``."""
        grid = getattr(mesh, "mesh", None)
        if grid is None or grid.dim() != 2:
            raise ValueError(
                "Topology.from_mesh takes a 2-D DeviceMesh of shape (machines, ranks within a "
                f"machine), e.g. init_device_mesh('cuda', (2, 8)); got {mesh!r}."
            )
        return cls(grid.tolist())

    @property
    def nnodes(self) -> int:
        return len(self.machines)

    @property
    def even(self) -> bool:
        """Whether every machine holds as many ranks."""
        return len({len(m) for m in self.machines}) == 1

    @property
    def nproc_per_node(self) -> int:
        """Ranks a machine (the first machine's, where they differ)."""
        return len(self.machines[0])

    def describe(self) -> str:
        """Words for the shape: ``"2 machines x 8 ranks"``, or each machine's count."""
        if self.even:
            n, g = self.nnodes, self.nproc_per_node
            return f"{n} machine{'s' * (n != 1)} x {g} rank{'s' * (g != 1)}"
        return f"{self.nnodes} machines of {[len(m) for m in self.machines]} ranks"

    def two_hops(self) -> bool:
        """Whether summing within machines first sends less across them: two or more
        machines of two or more ranks each, as many on each."""
        return self.even and self.nnodes > 1 and self.nproc_per_node > 1

    def check_covers(self, ranks: Sequence[int], owner: str) -> None:
        """Raise ``ValueError`` unless this topology holds exactly ``ranks``."""
        if sorted(r for m in self.machines for r in m) != sorted(ranks):
            raise ValueError(
                f"{owner}: the topology {self.describe()} holds ranks "
                f"{sorted(r for m in self.machines for r in m)}, but the hook's group holds "
                f"{sorted(ranks)}; give a Topology of the group's ranks, or "
                "topology='auto' to find it from the launcher."
            )


def _rank_lists(machines: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``machines`` in order, each rank an integer (``1.0``, ``True`` or ``"1"`` is refused
    rather than read as a rank)."""
    try:
        lists = [[_rank(r) for r in ranks] for ranks in machines]
    except TypeError as exc:
        raise ValueError(
            "Topology takes one list of integer global ranks per machine, e.g. "
            f"Topology([[0, 1], [2, 3]]); got {machines!r} ({exc})."
        ) from None
    return tuple(sorted(tuple(sorted(ranks)) for ranks in lists))


def _rank(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not a rank")
    return operator.index(value)


_found: "weakref.WeakKeyDictionary[dist.ProcessGroup, Topology]" = weakref.WeakKeyDictionary()


def find(group: dist.ProcessGroup) -> Topology:
    """The machines of ``group``'s ranks, from their launch environments: one blocking gather
    at the first call for a group (collective), remembered after."""
    known = _found.get(group)
    if known is None:
        infos = all_gather_objects(local_launch_info(), group)
        lists, _ = machine_rank_lists(infos)
        ranks = global_ranks(group)
        known = _found[group] = Topology([[ranks[i] for i in m] for m in lists])
    return known


@dataclass(frozen=True)
class TwoHops:
    """The groups of a two-hop average, from one rank's view: ``intra`` (its machine's ranks),
    ``intra_follow`` (theirs again, for the follow-ups; NCCL's is ``intra`` itself), ``peers``
    (the ranks holding the same share on every machine), ``peers_follow`` (theirs again, for the
    all-gather after their all-to-all; NCCL's is ``peers``), this rank's place among its peers
    (``machine``) and within its machine (``local``: the share it holds), and the topology's
    shape."""

    intra: dist.ProcessGroup
    intra_follow: dist.ProcessGroup
    peers: dist.ProcessGroup
    peers_follow: dist.ProcessGroup
    machine: int
    local: int
    nnodes: int
    nproc_per_node: int


def two_hops(group: dist.ProcessGroup, topology: Topology) -> TwoHops:
    """The groups of a two-hop average over ``group`` on ``topology`` (even, two machines or
    more), made now, each by its members only, in the same order on every rank: this rank's
    machine, the ranks of its share on every machine, each again for follow-ups."""
    me = dist.get_rank()
    machine = next(i for i, m in enumerate(topology.machines) if me in m)
    local = topology.machines[machine].index(me)
    intra = subgroup(list(topology.machines[machine]), group)
    peers = subgroup([m[local] for m in topology.machines], group)
    # A rank's places are its ranks in the groups (which order their ranks), not its indices
    # in the lists: the counterparts of ranks [0, 3] and [1, 2] are [0, 1] and [2, 3].
    local, machine = group_rank(intra), group_rank(peers)
    return TwoHops(
        intra, follow_up_group(intra), peers, follow_up_group(peers), machine, local,
        topology.nnodes, topology.nproc_per_node,
    )  # fmt: skip
