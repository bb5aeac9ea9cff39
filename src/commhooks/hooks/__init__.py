"""Hook families, one module each."""

from commhooks.hooks import debugging, default, quantized
from commhooks.hooks.debugging import *  # noqa: F403
from commhooks.hooks.default import *  # noqa: F403
from commhooks.hooks.local_sgd import PostLocalSGDState, post_localSGD_hook
from commhooks.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from commhooks.hooks.quantized import *  # noqa: F403

__all__ = ["PostLocalSGDState", "PowerSGDState", "batched_powerSGD_hook", "post_localSGD_hook"]
__all__ += ["powerSGD_hook", *debugging.__all__, *default.__all__, *quantized.__all__]
