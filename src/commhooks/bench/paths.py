"""Which path a hook's average takes on a cluster shape: the one place the cost model asks.

The quantized hooks average in two hops where the group spans two or more machines of two or
more ranks each (``topology="auto"``, their default): the float32 sum inside each machine,
the quantized two-phase average of the machine's share across machines, an all-gather inside.
With one rank a machine, or on one machine, or with ``topology="flat"``, they take the flat
two-phase average over every rank. A build whose hooks do not take ``topology`` has the flat
path only. DiLoCo's workers are ranks in the bench (each rank a worker of its own): their
float32 syncs are allreduces over every rank, but their quantized averages (``bits``, and the
warm-up's ``warmup_bits``) are the quantized hook's, which hop as it does.
"""

from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from commhooks.bench.shape import Shape

__all__ = ["FLAT", "sums_gradients", "two_hops", "two_hops_for"]

FLAT = "flat"
_TOPOLOGY = "topology"


@cache
def _takes_topology(hook: str) -> bool:
    """Whether this build's ``hook`` has the two-hop path (its options take ``topology``)."""
    if hook.startswith(("torch_", "floor_")):
        return False
    from commhooks import config

    try:
        return _TOPOLOGY in config.hook_spec(hook).options
    except (KeyError, ValueError):  # not one of ours
        return False


@cache
def _averages_quantized(hook: str) -> bool:
    """Whether ``hook`` is one of DiLoCo's, whose ``bits`` and ``warmup_bits`` choose the
    quantized hook's average for its syncs and its warm-up."""
    if hook.startswith(("torch_", "floor_")):
        return False
    from commhooks import config

    try:
        return {"bits", "warmup_bits", "sync_every"} <= config.hook_spec(hook).options
    except (KeyError, ValueError):
        return False


def _may_hop(hook: str, options: Mapping[str, Any]) -> bool:
    """Whether ``hook`` with ``options`` has a quantized average that takes two hops where a
    shape allows it."""
    if _takes_topology(hook):
        return bool(options.get(_TOPOLOGY, "auto") != FLAT)
    bits = (options.get("bits"), options.get("warmup_bits"))
    return _averages_quantized(hook) and any(b is not None for b in bits)


def two_hops(hook: str, options: Mapping[str, Any], shape: Shape) -> bool:
    """Whether ``hook``, built with ``options``, averages in two hops on ``shape``.

    Change this function, and only this one, when the hooks change how they choose.
    """
    return _may_hop(hook, options) and shape.nodes >= 2 and shape.per_node >= 2


def two_hops_for(hook: str, options: Mapping[str, Any]) -> Callable[[Shape], bool] | None:
    """:func:`two_hops` for one hook, as the cost model takes it; ``None`` for a hook that is
    always flat."""
    if not _may_hop(hook, options):
        return None
    frozen = dict(options)
    return lambda shape: two_hops(hook, frozen, shape)


def sums_gradients(hook: str, hops: Callable[[Shape], bool] | None) -> bool:
    """Whether ``hook``'s two hops sum every step's gradients inside the machine (the quantized
    hooks), rather than a DiLoCo fragment now and then."""
    return hops is not None and _takes_topology(hook)
