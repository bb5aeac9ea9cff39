"""PowerSGD: low-rank gradient compression with error feedback and warm start.

The hooks (:mod:`.hooks`) run each bucket's step (:mod:`.step`); :class:`PowerSGDState`
(:mod:`.state`) holds the options (:mod:`.options`) and what is remembered between steps,
which :mod:`.codec` saves and loads. ``ARCHITECTURE.md`` at the repository's root draws the map.
"""

from .hooks import batched_powerSGD_hook, powerSGD_hook, state_maker
from .options import PowerSGDOptions
from .state import PowerSGDState

__all__ = [
    "PowerSGDOptions",
    "PowerSGDState",
    "batched_powerSGD_hook",
    "powerSGD_hook",
    "state_maker",
]
