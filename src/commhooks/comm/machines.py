"""Which ranks share a machine, derived from the launch environment.

PyTorch's ``new_subgroups()`` sizes its groups by the number of CUDA devices, so it refuses to
run on CPU-only machines. We ask the launcher instead: each rank contributes one
:class:`LaunchInfo` (its machine name and torchrun's ``LOCAL_WORLD_SIZE``), the infos are
gathered once, and :func:`machine_rank_lists` turns them into groups. Everything here is pure
Python so it can be tested without processes.

How a rank's machine is named, first match wins:

1. ``COMMHOOKS_MACHINE_ID``: an explicit label; ranks with equal labels share a machine, and
   ``LOCAL_WORLD_SIZE`` is then ignored. Use it when host names are not unique (containers
   with identical host names) or to simulate several machines on one host.
2. the host name (``socket.gethostname()``), split further by ``LOCAL_WORLD_SIZE`` when a host
   runs several launcher groups (torchrun gives each node a contiguous block of ranks, so a
   host's ranks are cut into consecutive blocks of that size).
"""

import os
import socket
from dataclasses import dataclass

__all__ = ["MACHINE_ID_VAR", "LaunchInfo", "local_launch_info", "machine_rank_lists"]

MACHINE_ID_VAR = "COMMHOOKS_MACHINE_ID"


@dataclass(frozen=True)
class LaunchInfo:
    """What one rank knows about where it runs.

    Attributes:
        host: the host name.
        label: ``COMMHOOKS_MACHINE_ID``, or ``None`` when not set.
        local_world_size: torchrun's ``LOCAL_WORLD_SIZE``, or ``None`` when not set or invalid.
    """

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
    """Group ranks (indices into ``infos``) by machine.

    Returns:
        the rank lists, ordered by their lowest rank (the same on every rank, which matters
        because groups must be created in the same order everywhere), and a sentence saying
        how they were derived.
    """
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
