"""PowerSGD: low-rank gradient compression with error feedback and warm start.

The hooks (:mod:`.hooks`) hand each bucket to a pipeline (:mod:`.two_rounds`,
:mod:`.one_round`) built from the stages of :mod:`.stages`; :class:`PowerSGDState` (:mod:`.state`)
holds the options (:mod:`.options`) and the parts that remember between steps, and
:mod:`.codec` saves and loads them. ``ARCHITECTURE.md`` at the repository's root draws the map.
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
