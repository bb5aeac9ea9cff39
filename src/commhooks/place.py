"""Where on a device mesh a rank's state lives, beyond its rank in the group it averages over.

A state's error memories describe the elements this rank compresses. Under FSDP2 the hook
averages over the replicate group, where shard neighbours share their rank while holding other
rows of every parameter: a state also saves its shard coordinate and layout, and a memory loaded
at another place is reset. A place is a flat mapping of names to integers or strings.
"""

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from commhooks.state import StateDictError

__all__ = ["MeshPlace", "checked", "describe", "differs", "shard_place"]

MeshPlace = dict[str, int | str]
"""``{"shard_rank": 1, "shard_size": 2, "shard_layout": "<digest>"}``; empty under DDP."""


def shard_place(
    shard_rank: int, shard_size: int, shards: Iterable[tuple[torch.Size, torch.Size]]
) -> MeshPlace:
    """The place of a rank holding ``shards`` (each parameter's full and shard shape): the
    layout, a digest of them and the coordinate, is equal where the same rows are held."""
    text = ";".join(f"{tuple(full)}>{tuple(part)}" for full, part in shards)
    text += f"|{shard_rank}/{shard_size}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return {"shard_rank": shard_rank, "shard_size": shard_size, "shard_layout": digest}


def checked(where: str, value: Any) -> MeshPlace:
    """A loaded place, or ``StateDictError`` naming the entry."""
    if not isinstance(value, Mapping):
        raise StateDictError(f"{where} must be a mapping of names to integers or strings.")
    place: MeshPlace = {}
    for name, item in value.items():
        ok = isinstance(item, (int, str)) and not isinstance(item, bool)
        if not isinstance(name, str) or not ok:
            raise StateDictError(
                f"{where} must map names to integers or strings; got {name!r}: {item!r}."
            )
        place[name] = item
    return place


def differs(saved: Mapping[str, Any], here: Mapping[str, Any]) -> bool:
    """Whether a state saved at ``saved`` describes other elements than one used ``here``."""
    return any(saved.get(name) != here.get(name) for name in set(saved) | set(here))


def describe(place: Mapping[str, Any]) -> str:
    """``"shard rank 1 of 2 (shard layout ab12...)"``, or where none is known, says so."""
    if not place:
        return "no mesh place (a DDP run, or a file of an earlier release)"
    if {"shard_rank", "shard_size", "shard_layout"} <= set(place):
        return (
            f"shard rank {place['shard_rank']} of {place['shard_size']} "
            f"(shard layout {place['shard_layout']})"
        )
    return ", ".join(f"{k}={v}" for k, v in sorted(place.items()))
