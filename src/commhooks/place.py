"""Where on a device mesh a rank's state lives, beyond its rank in the group it averages over.

A hook state's error memories describe the elements this rank compresses. Under DDP those are
fixed by the rank in the hook's group; under FSDP2 (:mod:`commhooks.fsdp`) the hook averages
over the replicate group only, and the ranks of one shard group share their place in it while
holding different rows of every parameter. A state saved by a shard neighbour then looks like
this rank's own, so the place a state is saved at also names the rank's coordinate in the shard
dimension and the layout of the shard it holds: a memory loaded elsewhere describes other
elements and is reset (see the states' ``load_state_dict``).

A place is a flat mapping of names to integers or strings, saved as it is in state dicts.
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
    """The place of a rank holding ``shards``: each parameter's ``(full shape, shard shape)``.

    The layout is a digest of the shapes, the shard group's size and this rank's coordinate
    in it: equal exactly where the same rows of the same parameters are held.
    """
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
