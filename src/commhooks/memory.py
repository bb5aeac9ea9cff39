"""The error-feedback memories under their former module name, for code that imports them here.

They live in :mod:`commhooks.error_feedback`, whose name says what they hold.
"""

from commhooks.error_feedback import Absorbed as Absorbed
from commhooks.error_feedback import ErrorFeedback as ErrorFeedback
from commhooks.error_feedback import Key as Key
from commhooks.error_feedback import LazyErrorFeedback as LazyErrorFeedback
from commhooks.error_feedback import Plausible as Plausible

__all__ = ["Absorbed", "ErrorFeedback", "Key", "LazyErrorFeedback", "Plausible"]
